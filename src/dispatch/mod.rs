//! Stage 2: jobs out. Reserves due jobs, hands each to the sink its topic routes to
//! (`sink.rs`: the ready exchange, or a `[[targets]]` webhook), and releases each job
//! only once that sink delivered it; a failure puts the job back with backoff.
//!
//! A loop sleeps until the earliest due time it knows of, or until the store's
//! [`DueHints`] say a topic got earlier work. Due-ness itself is decided by the reserve
//! script on the Redis server's clock, so waking early is harmless and a job is never
//! sent early.
//!
//! Here: the [`Dispatcher`] and what both loops share (the plan's upkeep, the nap, one
//! grouped reserve, the rescan). `amqp_loop.rs` the AMQP session's loop and publishing,
//! `webhook_loop.rs` the webhook loop, `plan.rs` the plan, `settle.rs` every outcome
//! (release, failure, backoff) for every sink, `confirm.rs` the AMQP confirms,
//! `webhook_sink.rs` the targets' slots, `expiry.rs` expired jobs, `clock.rs` the server
//! clock.

mod amqp_loop;
mod clock;
mod confirm;
mod expiry;
mod plan;
pub mod properties;
mod settle;
mod sink;
mod webhook_loop;
mod webhook_sink;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::feed::Feed;
use crate::job::Topic;
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::store::ReservedJob;
use crate::store::{DueHints, Store};
pub use clock::ServerClock;
pub use expiry::Expiry;
pub use plan::Plan;
pub use settle::retry_delay;
use settle::Settler;
use sink::{Route, Serves};
pub use webhook_sink::{slots_worth_a_reserve, WebhookSinks};

/// Due topics reserved from in one round trip.
const RESERVE_GROUP: usize = 64;

/// Topics whose earliest due time one rescan step re-reads.
pub const RESCAN_CHUNK: usize = 1000;

#[derive(Debug)]
pub struct Dispatcher {
    pub store: Store,
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub feed: Feed,
    pub hints: Arc<DueHints>,
    pub clock: Arc<ServerClock>,
    /// Failed publishes are retried; the log gets the first per topic and reason, then a
    /// summary per window, not a line per retry.
    pub warnings: Arc<LogThrottle>,
    /// The webhook targets' sink; kept across AMQP sessions with its requests.
    pub webhooks: Arc<WebhookSinks>,
    /// Expired jobs: the `[[policies]]` defaults, and the AMQP session's channel the
    /// webhook loop sets its expired jobs aside on (shared by both loops).
    pub expiry: Arc<Expiry>,
}

impl Dispatcher {
    fn settler(&self) -> Settler {
        Settler {
            store: self.store.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            feed: self.feed.clone(),
            clock: self.clock.clone(),
            hints: self.hints.clone(),
        }
    }

    /// Whether this loop plans `topic`: the AMQP loop every topic no target serves, the
    /// webhook loop the others.
    fn mine(&self, serves: Serves, topic: &Topic) -> bool {
        (self.webhooks.route(topic) == Route::Amqp) == (serves == Serves::Amqp)
    }

    /// Takes the hints into the plan and rescans topics: a full pass at start and after
    /// missed notifications; otherwise one chunk of topics per poll interval, so a tick
    /// never costs a call per topic.
    async fn update_plan(
        &self,
        plan: &mut Plan,
        poll: Duration,
        serves: Serves,
    ) -> Result<(), crate::store::StoreError> {
        for (topic, due) in self.hints.take_hints() {
            if self.mine(serves, &topic) {
                plan.hinted(topic, due);
            }
        }
        let full = self.hints.take_rescan() || plan.last_rescan.is_none();
        let rescan_due = plan.last_rescan.is_none_or(|at| at.elapsed() >= poll);
        if full || rescan_due {
            self.rescan(plan, full, serves).await?;
        }
        Ok(())
    }

    /// Sleeps until the earliest planned due time of a topic not in `full` (at most
    /// one poll interval), a hint, or a webhook slot freed; `false` on shutdown.
    async fn nap(
        &self,
        plan: &Plan,
        poll: Duration,
        full: &HashSet<Topic>,
        shutdown: &CancellationToken,
    ) -> bool {
        // To the instant the server's clock reaches the due time, not a whole number
        // of milliseconds from a rounded `now`: that rounding was lateness.
        let polled = Instant::now() + poll;
        let mut wake = plan
            .earliest_except(full)
            .map_or(polled, |due| self.clock.instant_of(due).min(polled));
        if !full.is_empty() {
            // A target's few free slots are served once its linger ends, even if no
            // other request ends meanwhile.
            if let Some(at) = self.webhooks.lingering_until() {
                wake = wake.min(at);
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => false,
            _ = self.hints.notified() => true,
            _ = self.webhooks.room_freed(), if !full.is_empty() => true,
            _ = tokio::time::sleep_until(wake.into()) => true,
        }
    }

    /// Reserves up to `each` jobs of every topic of `group` in one round trip and
    /// corrects the plan and the clock from the replies.
    async fn reserve_group(
        &self,
        plan: &mut Plan,
        group: &[Topic],
        ttr: Duration,
        each: usize,
    ) -> Result<Vec<(Topic, Vec<ReservedJob>)>, crate::store::StoreError> {
        let sent = Instant::now();
        let batches = self.store.reserve_many(group, ttr, each).await?;
        let mut reserved = Vec::with_capacity(group.len());
        for (topic, batch) in group.iter().zip(batches) {
            self.clock.observe(batch.now, sent);
            // A rate-limited topic is planned for its next token, not its (past) head:
            // no busy loop, and the other topics are served meanwhile.
            let next = match (batch.next_due, batch.next_token) {
                (Some(due), Some(token)) => Some(due.max(token)),
                (due, _) => due,
            };
            plan.reserved(topic, batch.paused, next);
            if !batch.corrupt.is_empty() {
                self.metrics
                    .corrupt_records
                    .inc_by(batch.corrupt.len() as u64);
                tracing::error!(%topic, ids = ?batch.corrupt, "scheduled ids with missing or unreadable records taken off the schedule; run `redisched check`");
            }
            reserved.push((topic.clone(), batch.jobs));
        }
        Ok(reserved)
    }

    /// Re-reads the earliest due time of the next [`RESCAN_CHUNK`] known topics, or of
    /// all of them when `full`. Hints (in-process and Pub/Sub) keep the plan current;
    /// this safety net only catches what they missed, so with T topics a missed hint
    /// is found within T / RESCAN_CHUNK poll intervals.
    async fn rescan(
        &self,
        plan: &mut Plan,
        full: bool,
        serves: Serves,
    ) -> Result<(), crate::store::StoreError> {
        let sent = Instant::now();
        let now = self.store.server_time().await?;
        self.clock.observe(now, sent);
        if full {
            plan.cursor = 0;
            // Notifications may have been missed: ask every topic again.
            plan.paused.clear();
        }
        loop {
            let (next, mut topics) = self.store.scan_topics(plan.cursor, RESCAN_CHUNK).await?;
            topics.retain(|topic| self.mine(serves, topic));
            let heads = self.store.next_due_times(&topics).await?;
            for (topic, head) in topics.into_iter().zip(heads) {
                plan.rescanned(&topic, head);
            }
            plan.cursor = next;
            if !full || next == 0 {
                break;
            }
        }
        plan.last_rescan = Some(Instant::now());
        Ok(())
    }
}

async fn sleep_or_shutdown(duration: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = tokio::time::sleep(duration) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let config = Config::default();
        assert_eq!(retry_delay(&config, 1), Duration::from_secs(1));
        assert_eq!(retry_delay(&config, 3), Duration::from_secs(4));
        assert_eq!(retry_delay(&config, 40), Duration::from_secs(60));
    }
}

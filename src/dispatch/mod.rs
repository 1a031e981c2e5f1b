//! Stage 2: jobs out. Reserves due jobs, publishes them to the ready exchange with
//! `mandatory` and publisher confirms, and releases each job only once the broker
//! acked it without returning it. A nack or a return puts the job back with backoff.
//!
//! The loop sleeps until the earliest due time it knows of, or until the store's [`DueHints`] say a
//! topic got earlier work. Due-ness itself is decided by the reserve script on the
//! Redis server's clock, so waking early is harmless and a job is never sent early.

mod clock;
mod confirm;
mod expiry;
mod plan;
mod settle;
mod sink;
mod webhook_sink;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, decode_meta, outgoing_properties, AmqpError};
use crate::config::Config;
use crate::feed::Feed;
use crate::job::Topic;
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::store::ReservedJob;
use crate::store::{DueHints, Store};
pub use clock::ServerClock;
use confirm::{Confirmer, InFlight};
pub use expiry::Expiry;
pub use plan::Plan;
pub use settle::retry_delay;
use settle::{Settler, Ticket};
use sink::{Route, Serves};
pub use webhook_sink::WebhookSinks;

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
    /// Dispatches over one AMQP connection until `shutdown` (then drains in-flight
    /// confirms within the grace period) or a broker error.
    pub async fn run(
        &self,
        plan: &mut Plan,
        connection: &Connection,
        shutdown: CancellationToken,
    ) -> Result<(), AmqpError> {
        let channel = amqp::confirm_channel(connection).await?;
        let blocked = watch_blocked(connection, shutdown.clone());
        let window = Arc::new(Semaphore::new(self.config.dispatch.window));
        let (in_flight, confirmed) = mpsc::unbounded_channel();
        self.expiry.set_session(Some(expiry::Session {
            channel: channel.clone(),
            confirms: in_flight.clone(),
        }));
        let settler = self.settler();
        let confirmer = Confirmer {
            settler: settler.clone(),
            warnings: self.warnings.clone(),
        };
        let mut confirmer = tokio::spawn(confirmer.run(confirmed));

        let result = self
            .dispatch_loop(
                plan, &channel, blocked, &window, &in_flight, &settler, &shutdown,
            )
            .await;
        // The confirmer ends once every sender is gone, the webhook loop's too.
        self.expiry.set_session(None);
        drop(in_flight);
        let grace = Duration::from_millis(self.config.dispatch.shutdown_grace_ms);
        if tokio::time::timeout(grace, &mut confirmer).await.is_err() {
            confirmer.abort();
            tracing::warn!(
                ?grace,
                "confirms still pending at the end of the grace period; those jobs stay reserved and are requeued after their time-to-run"
            );
        }
        amqp::close_quietly("dispatch channel", channel.close(200, "shutdown".into())).await;
        result
    }

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

    /// Dispatches the webhook targets' topics until `shutdown`, with no broker involved:
    /// bring the plan up to date, nap until something is due (or a slot frees), then
    /// reserve for each target's due topics what it has free slots for and POST each job
    /// at once. Runs beside the AMQP sessions, on a plan and hints of its own, so a
    /// broker outage or block does not stop webhook deliveries. On shutdown, requests in
    /// flight get `dispatch.shutdown_grace_ms`.
    pub async fn run_webhooks(&self, plan: &mut Plan, shutdown: CancellationToken) {
        let cfg = &self.config.dispatch;
        let poll = Duration::from_millis(cfg.poll_interval_ms);
        let ttr = Duration::from_millis(cfg.ttr_ms);
        let settler = self.settler();
        let mut redis_backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let step = async {
                self.update_plan(plan, poll, Serves::Webhooks).await?;
                let now = self.clock.now();
                let mut due = plan.due(now);
                plan.turn = plan.turn.wrapping_add(1);
                if !due.is_empty() {
                    let start = plan.turn % due.len();
                    due.rotate_left(start);
                }
                let (hooks, full) = self.split_by_target(due);
                if hooks.is_empty() {
                    // Nothing due, or only topics of targets without a free slot: sleep
                    // until a slot frees, a hint, or the next topic that can be served.
                    self.nap(plan, now, poll, &full, &shutdown).await;
                    return Ok(());
                }
                self.reserve_for_webhooks(plan, hooks, ttr, &settler).await
            };
            match step.await {
                Ok(()) => redis_backoff = Duration::from_millis(100),
                Err(err) => {
                    tracing::warn!(error = %err, retry_in = ?redis_backoff, "redis unavailable; webhook dispatch waits");
                    sleep_or_shutdown(redis_backoff, &shutdown).await;
                    redis_backoff = (redis_backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        let grace = Duration::from_millis(cfg.shutdown_grace_ms);
        if !self.webhooks.drain(grace).await {
            tracing::warn!(
                ?grace,
                "webhook requests still running at the end of the grace period; those jobs stay reserved and are requeued after their time-to-run"
            );
        }
    }

    /// Whether this loop plans `topic`: the AMQP loop every topic no target serves, the
    /// webhook loop the others.
    fn mine(&self, serves: Serves, topic: &Topic) -> bool {
        (self.webhooks.route(topic) == Route::Amqp) == (serves == Serves::Amqp)
    }

    /// The dispatch loop, one named step per line: wait out a broker block, bring the
    /// plan up to date, nap until something is due, then reserve and publish the due
    /// topics a group at a time within the confirm window.
    #[allow(clippy::too_many_arguments)]
    async fn dispatch_loop(
        &self,
        plan: &mut Plan,
        channel: &Channel,
        mut blocked: watch::Receiver<bool>,
        window: &Arc<Semaphore>,
        in_flight: &mpsc::UnboundedSender<InFlight>,
        settler: &Settler,
        shutdown: &CancellationToken,
    ) -> Result<(), AmqpError> {
        let cfg = &self.config.dispatch;
        let poll = Duration::from_millis(cfg.poll_interval_ms);
        let ttr = Duration::from_millis(cfg.ttr_ms);
        let mut redis_backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            if *blocked.borrow() {
                if !wait_unblocked(&mut blocked, shutdown).await {
                    break;
                }
                continue;
            }
            if let Err(err) = self.update_plan(plan, poll, Serves::Amqp).await {
                tracing::warn!(error = %err, retry_in = ?redis_backoff, "redis unavailable; dispatch waits");
                sleep_or_shutdown(redis_backoff, shutdown).await;
                redis_backoff = (redis_backoff * 2).min(Duration::from_secs(5));
                continue;
            }

            let now = self.clock.now();
            let mut due = plan.due(now);
            if due.is_empty() {
                if !self.nap(plan, now, poll, &HashSet::new(), shutdown).await {
                    break;
                }
                continue;
            }
            // Start each round at another topic, so none is always served last.
            plan.turn = plan.turn.wrapping_add(1);
            let start = plan.turn % due.len();
            due.rotate_left(start);

            for group in due.chunks(RESERVE_GROUP) {
                // Wait for room in the confirm window before taking more jobs.
                let first_permit = tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    permit = window.clone().acquire_owned() => match permit {
                        Ok(p) => p,
                        Err(_) => return Ok(()),
                    },
                };
                let room = window.available_permits() + 1;
                let each = (room / group.len()).clamp(1, cfg.batch);
                let reserved = match self.reserve_group(plan, group, ttr, each).await {
                    Ok(reserved) => reserved,
                    Err(err) => {
                        tracing::warn!(error = %err, "reserve failed");
                        sleep_or_shutdown(redis_backoff, shutdown).await;
                        redis_backoff = (redis_backoff * 2).min(Duration::from_secs(5));
                        break;
                    }
                };
                redis_backoff = Duration::from_millis(100);
                if !self
                    .publish_reserved(channel, reserved, first_permit, window, in_flight, settler)
                    .await?
                {
                    return Ok(());
                }
            }
        }
        Ok(())
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
        now: i64,
        poll: Duration,
        full: &HashSet<Topic>,
        shutdown: &CancellationToken,
    ) -> bool {
        let nap = plan
            .earliest_except(full)
            .map(|d| Duration::from_millis(u64::try_from(d - now).unwrap_or(0)))
            .unwrap_or(poll)
            .min(poll);
        tokio::select! {
            _ = shutdown.cancelled() => false,
            _ = self.hints.notified() => true,
            _ = self.webhooks.room_freed(), if !full.is_empty() => true,
            _ = tokio::time::sleep(nap) => true,
        }
    }

    /// Groups due webhook topics by target, each target's list cut to its free slots;
    /// also returns the topics left out for want of a slot (served again once a
    /// request ends).
    fn split_by_target(&self, due: Vec<Topic>) -> (Vec<(usize, Vec<Topic>)>, HashSet<Topic>) {
        let mut hooks: Vec<(usize, Vec<Topic>)> = Vec::new();
        let mut full = HashSet::new();
        for topic in due {
            match self.webhooks.route(&topic) {
                Route::Amqp => {}
                Route::Webhook(index) => {
                    let room = self.webhooks.room(index);
                    match hooks.iter_mut().find(|(i, _)| *i == index) {
                        Some((_, topics)) if topics.len() < room => topics.push(topic),
                        None if room > 0 => hooks.push((index, vec![topic])),
                        _ => {
                            full.insert(topic);
                        }
                    }
                }
            }
        }
        (hooks, full)
    }

    /// Reserves, per target, at most its free slots' worth of jobs over its due
    /// topics, and starts POSTing each at once.
    async fn reserve_for_webhooks(
        &self,
        plan: &mut Plan,
        hooks: Vec<(usize, Vec<Topic>)>,
        ttr: Duration,
        settler: &Settler,
    ) -> Result<(), crate::store::StoreError> {
        for (index, topics) in hooks {
            let room = self.webhooks.room(index);
            if room == 0 {
                continue;
            }
            let each = (room / topics.len()).clamp(1, self.config.dispatch.batch);
            for group in topics.chunks(RESERVE_GROUP) {
                for (topic, jobs) in self.reserve_group(plan, group, ttr, each).await? {
                    for job in jobs {
                        match sink::ticket(&topic, &job) {
                            Err((lease, reason)) => {
                                settler.fail_unreadable(&lease, job.attempt, &reason).await;
                            }
                            Ok(ticket)
                                if self.expiry.take_expired(
                                    &self.config.amqp.expired_exchange,
                                    &topic,
                                    &job,
                                    &ticket,
                                    settler,
                                ) => {}
                            Ok(ticket) => {
                                let lease = ticket.lease.clone();
                                if self
                                    .webhooks
                                    .send(index, &topic, job, ticket, settler)
                                    .is_err()
                                {
                                    // Not expected: only this loop takes slots. Due again now
                                    // (or, if Redis does not answer, once the TTR expires).
                                    if let Err(error) =
                                        self.store.retry(&lease, Duration::ZERO).await
                                    {
                                        tracing::warn!(%error, topic = %topic, "could not hand a job back; its reservation expires into a requeue");
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
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
        let batches = self.store.reserve_many(group, ttr, each).await?;
        let mut reserved = Vec::with_capacity(group.len());
        for (topic, batch) in group.iter().zip(batches) {
            self.clock.observe(batch.now);
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

    /// Publishes reserved jobs in order, each under a permit of the confirm window
    /// (the first one already taken). `Ok(false)` when the window closed (the session
    /// is ending). If the channel fails, everything reserved and not sent is failed
    /// back to the store (`Settler::fail_unsent`), so it is due again now instead of
    /// after the TTR.
    async fn publish_reserved(
        &self,
        channel: &Channel,
        reserved: Vec<(Topic, Vec<ReservedJob>)>,
        first_permit: tokio::sync::OwnedSemaphorePermit,
        window: &Arc<Semaphore>,
        in_flight: &mpsc::UnboundedSender<InFlight>,
        settler: &Settler,
    ) -> Result<bool, AmqpError> {
        let mut first_permit = Some(first_permit);
        let mut topics = reserved.into_iter();
        while let Some((topic, jobs)) = topics.next() {
            let mut jobs = jobs.into_iter();
            while let Some(job) = jobs.next() {
                let permit = match first_permit.take() {
                    Some(p) => p,
                    None => match window.clone().acquire_owned().await {
                        Ok(p) => p,
                        Err(_) => return Ok(false),
                    },
                };
                if let Err(err) = self
                    .publish(channel, &topic, &job, permit, in_flight, settler)
                    .await
                {
                    let reason = format!("channel error: {err}");
                    let unsent = std::iter::once(job).chain(jobs).collect();
                    settler.fail_unsent(&topic, unsent, &reason).await;
                    for (topic, jobs) in topics {
                        settler.fail_unsent(&topic, jobs, &reason).await;
                    }
                    return Err(err);
                }
            }
        }
        Ok(true)
    }

    async fn publish(
        &self,
        channel: &Channel,
        topic: &Topic,
        job: &ReservedJob,
        permit: tokio::sync::OwnedSemaphorePermit,
        in_flight: &mpsc::UnboundedSender<InFlight>,
        settler: &Settler,
    ) -> Result<(), AmqpError> {
        let mut ticket: Ticket = match sink::ticket(topic, job) {
            Ok(ticket) => ticket,
            Err((lease, reason)) => {
                drop(permit);
                settler.fail_unreadable(&lease, job.attempt, &reason).await;
                return Ok(());
            }
        };
        let stored = decode_meta(&job.meta).unwrap_or_else(|err| {
            tracing::warn!(%topic, id = %job.id, %err, "job metadata unreadable; delivering without it");
            Default::default()
        });
        // Not delivered by due + expires-after (on the server's clock, as just read by
        // the reserve): set aside to the expired exchange instead, through the same
        // confirms; released once that copy is confirmed.
        let (exchange, props) =
            match self
                .expiry
                .expired_at(topic, ticket.due_at, &stored, self.clock.now())
            {
                Some(ms) => {
                    ticket = expiry::mark_expired(ticket, ms);
                    (
                        &self.config.amqp.expired_exchange,
                        expiry::expired_properties(topic, job, stored, ticket.due_at, ms),
                    )
                }
                None => (
                    &self.config.amqp.ready_exchange,
                    outgoing_properties(topic.as_str(), job, stored, ticket.due_at),
                ),
            };
        let (key, confirm) = expiry::publish(channel, exchange, topic, job, props).await?;
        let flight = InFlight {
            ticket,
            key,
            confirm,
            permit: Some(permit),
        };
        // The confirmer only stops after this sender is dropped, so it still listens.
        if !flight.hand_to(in_flight, &self.metrics) {
            tracing::warn!("the confirmer has stopped; a published job waits for its requeue");
        }
        Ok(())
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
        let now = self.store.server_time().await?;
        self.clock.observe(now);
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

/// Waits while the broker blocks publishers (a resource alarm); `false` on shutdown.
async fn wait_unblocked(blocked: &mut watch::Receiver<bool>, shutdown: &CancellationToken) -> bool {
    tracing::warn!("broker blocked publishers (resource alarm); dispatch paused");
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = blocked.wait_for(|b| !*b) => {
            tracing::info!("broker unblocked; dispatch resumes");
            true
        }
    }
}

async fn sleep_or_shutdown(duration: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = tokio::time::sleep(duration) => {}
    }
}

/// Tracks connection.blocked / unblocked: while blocked, publishes would only pile up
/// unconfirmed and their reservations would expire, so the loop pauses instead.
fn watch_blocked(connection: &Connection, shutdown: CancellationToken) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    let mut events = Box::pin(connection.events_listener());
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tx.closed() => return,
                event = events.next() => event,
            };
            match event {
                Some(lapin::Event::ConnectionBlocked(reason)) => {
                    tracing::warn!(%reason, "connection blocked by the broker");
                    tx.send_replace(true);
                }
                Some(lapin::Event::ConnectionUnblocked) => {
                    tx.send_replace(false);
                }
                Some(_) => {}
                None => return,
            }
        }
    });
    rx
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

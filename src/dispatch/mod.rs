//! Stage 2: jobs out. Reserves due jobs, hands each to the sink its topic routes to,
//! and releases each job only once that sink delivered it; a failure puts the job back
//! with backoff.
//!
//! Each sink has a loop (`Dispatcher::run`, here): bring its plan up to date, nap
//! until the earliest due time it knows of (or until the store's [`DueHints`] say a
//! topic got earlier work, or the sink freed room), then hand the due topics to the
//! sink's round. Due-ness itself is decided by the reserve script on the Redis
//! server's clock, so waking early is harmless and a job is never sent early.
//!
//! Here: the [`Dispatcher`], its loops, the [`Core`] each turn lends the sink's round,
//! and where routes are chosen ([`routes`]). Beside it, shared by every sink: `sink.rs`
//! the seam (the [`Sink`] trait, [`Routes`]), `plan.rs` the plan, `clock.rs` the server
//! clock, `reserve.rs` the reserve (`Core`'s methods) and each job's triage into a
//! [`Reserved`] job with its settle [`Ticket`], `set_aside.rs` expired jobs set aside,
//! `settle.rs` every outcome (release, failure, backoff). One folder per sink: `amqp/`
//! (the ready exchange, per AMQP session) and `webhook/` (`[[targets]]`, for the whole
//! process); the two never import each other.

mod amqp;
mod clock;
mod plan;
mod reserve;
mod set_aside;
mod settle;
mod sink;
mod webhook;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::amqp::AmqpError;
use crate::config::Config;
use crate::feed::Feed;
use crate::job::Topic;
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::store::{DueHints, Store, StoreError};
use amqp::AmqpSink;
pub use clock::ServerClock;
pub use plan::Plan;
pub use reserve::{Held, Learned, Reserved, Ticket, RESERVE_GROUP};
pub use set_aside::SetAside;
pub use settle::{retry_delay, Settler};
pub use sink::{Round, RoundError, Route, Routes, Sink};
pub use webhook::{slots_worth_a_reserve, WebhookSinks, FORWARDED_PREFIX};

/// Topics whose earliest due time one rescan step re-reads.
pub const RESCAN_CHUNK: usize = 1000;

/// The sinks beside AMQP, in the order they are asked whether they serve a topic: the
/// `[[targets]]` webhooks, then `added` (a library user's own). The one place a sink
/// is added.
/// `events`: where the webhook targets' state changes go (`crate::events`).
pub fn routes(
    config: &Config,
    added: Vec<Arc<dyn Sink>>,
    events: Option<crate::events::EventSender>,
) -> Result<Routes, String> {
    let mut sinks: Vec<Arc<dyn Sink>> = Vec::new();
    if !config.targets.is_empty() {
        sinks.push(Arc::new(WebhookSinks::new(config, events)?));
    }
    sinks.extend(added);
    Ok(Routes::new(sinks))
}

#[derive(Debug)]
pub struct Dispatcher {
    pub store: Store,
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub feed: Feed,
    /// The board of this loop's hints (each sink's loop has its own copy).
    pub hints: Arc<DueHints>,
    pub clock: Arc<ServerClock>,
    /// Failed publishes are retried; the log gets the first per topic and reason, then a
    /// summary per window, not a line per retry.
    pub warnings: Arc<LogThrottle>,
    /// Which sink each topic goes to; the sinks beside AMQP, kept across AMQP sessions
    /// with their deliveries.
    pub routes: Arc<Routes>,
    /// Expired jobs, judged and set aside for every sink.
    pub set_aside: Arc<SetAside>,
}

/// What a sink's round borrows from its loop: the reserve (its methods are in
/// `reserve.rs`), and where outcomes go. Each turn of its loop lends one.
#[derive(Debug)]
pub struct Core<'a> {
    dispatcher: &'a Dispatcher,
    /// Where the reserve leaves what its replies said, for the plan's next turn.
    learned: &'a mut Learned,
    settler: &'a Arc<Settler>,
    shutdown: &'a CancellationToken,
}

impl Core<'_> {
    /// Where the sink reports each job's outcome.
    pub fn settler(&self) -> &Arc<Settler> {
        self.settler
    }

    /// The bridge's shutdown: a round that waits gives up when it comes.
    pub fn shutdown(&self) -> &CancellationToken {
        self.shutdown
    }

    /// `dispatch.batch`: the most jobs of one topic a reserve takes.
    pub fn batch(&self) -> usize {
        self.dispatcher.config.dispatch.batch
    }
}

impl Dispatcher {
    /// The dispatch stage's AMQP session: on one connection, the set-aside's confirm
    /// channel and the AMQP sink's lanes; runs the AMQP sink's loop until `shutdown`
    /// (then drains in-flight confirms within the grace period) or a broker error.
    pub async fn run_session(
        &self,
        plan: &mut Plan,
        connection: &Connection,
        shutdown: CancellationToken,
    ) -> Result<(), AmqpError> {
        let (settler, warnings) = (self.settler(), self.warnings.clone());
        let aside = self
            .set_aside
            .open(connection, settler.clone(), warnings)
            .await?;
        let sink = AmqpSink::open(
            connection,
            &self.config,
            &settler,
            &self.warnings,
            &shutdown,
        );
        let sink = sink.await?;
        let result = self.run(&sink, Route::Amqp, plan, &shutdown).await;
        let grace = Duration::from_millis(self.config.dispatch.shutdown_grace_ms);
        tokio::join!(sink.close(grace), aside.close(grace));
        result
    }

    /// The loop of the sink beside AMQP at `index` of the routes, for the whole process
    /// and with no broker involved, on a plan of its own. On shutdown, its deliveries in
    /// flight get `dispatch.shutdown_grace_ms`.
    pub async fn run_sink(&self, index: usize, shutdown: CancellationToken) {
        let Some(sink) = self.routes.sinks().get(index).cloned() else {
            return;
        };
        let mut plan = Plan::default();
        // Only the AMQP sink's loop ends on an error; this one ends with the shutdown.
        self.run(&*sink, Route::Sink(index), &mut plan, &shutdown)
            .await
            .ok();
        let grace = Duration::from_millis(self.config.dispatch.shutdown_grace_ms);
        sink.drain(grace).await;
    }

    /// One sink's loop over the topics routed to it, one [`Dispatcher::turn`] after
    /// another, until `shutdown`; while Redis does not answer, it waits with backoff.
    /// The AMQP sink's loop also ends when its channel fails.
    async fn run<S: Sink + ?Sized>(
        &self,
        sink: &S,
        route: Route,
        plan: &mut Plan,
        shutdown: &CancellationToken,
    ) -> Result<(), AmqpError> {
        let settler = Arc::new(self.settler());
        let mut backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let what = match self.turn(sink, route, plan, &settler, shutdown).await {
                Ok(()) => {
                    backoff = Duration::from_millis(100);
                    continue;
                }
                Err(RoundError::Broker(err)) if route == Route::Amqp => return Err(err),
                Err(RoundError::Store(err)) => ("redis", err.to_string()),
                Err(RoundError::Broker(err)) => ("broker", err.to_string()),
            };
            let (unavailable, error) = what;
            tracing::warn!(%error, retry_in = ?backoff, "{unavailable} unavailable; {} waits", sink.name());
            sleep_or_shutdown(backoff, shutdown).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
        Ok(())
    }

    /// One turn of a sink's loop: bring the plan up to date, hand the due topics to the
    /// sink's round, and nap if it took nothing.
    async fn turn<S: Sink + ?Sized>(
        &self,
        sink: &S,
        route: Route,
        plan: &mut Plan,
        settler: &Arc<Settler>,
        shutdown: &CancellationToken,
    ) -> Result<(), RoundError> {
        let poll = Duration::from_millis(self.config.dispatch.poll_interval_ms);
        self.update_plan(plan, poll, route).await?;
        let due = plan.due_in_turn(self.clock.now());
        let mut core = Core {
            dispatcher: self,
            learned: &mut plan.learned,
            settler,
            shutdown,
        };
        if let Round::Idle(waiting) = sink.round(due, &mut core).await? {
            // No job taken: what the replies said (a rate limit's next token, say) sets
            // the nap's end now rather than one more turn later.
            plan.learn();
            self.nap(plan, poll, &waiting, sink, shutdown).await;
        }
        Ok(())
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

    /// Whether `route`'s loop plans `topic`.
    fn mine(&self, route: Route, topic: &Topic) -> bool {
        self.routes.route(topic) == route
    }

    /// Takes into the plan what the last round's replies said, then the hints, and
    /// rescans topics: a full pass at start and after missed notifications; otherwise
    /// one chunk of topics per poll interval, so a tick never costs a call per topic.
    async fn update_plan(
        &self,
        plan: &mut Plan,
        poll: Duration,
        route: Route,
    ) -> Result<(), StoreError> {
        plan.learn();
        for (topic, due) in self.hints.take_hints() {
            if self.mine(route, &topic) {
                plan.hinted(topic, due);
            }
        }
        let full = self.hints.take_rescan() || plan.last_rescan.is_none();
        let rescan_due = plan.last_rescan.is_none_or(|at| at.elapsed() >= poll);
        if full || rescan_due {
            self.rescan(plan, full, route).await?;
        }
        Ok(())
    }

    /// Sleeps until the earliest planned due time of a topic not `waiting` for room (at
    /// most one poll interval), a hint, or room freed in the sink.
    async fn nap<S: Sink + ?Sized>(
        &self,
        plan: &Plan,
        poll: Duration,
        waiting: &HashSet<Topic>,
        sink: &S,
        shutdown: &CancellationToken,
    ) {
        // To the instant the server's clock reaches the due time, not a whole number
        // of milliseconds from a rounded `now`: that rounding was lateness.
        let polled = Instant::now() + poll;
        let mut wake = plan
            .earliest_except(waiting)
            .map_or(polled, |due| self.clock.instant_of(due).min(polled));
        if !waiting.is_empty() {
            // A sink's few free slots are served once its linger ends, even if no
            // other delivery ends meanwhile.
            if let Some(at) = sink.lingering_until() {
                wake = wake.min(at);
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = self.hints.notified() => {}
            _ = sink.room_freed(), if !waiting.is_empty() => {}
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
    }

    /// Re-reads the earliest due time of the next [`RESCAN_CHUNK`] known topics, or of
    /// all of them when `full`. Hints (in-process and Pub/Sub) keep the plan current;
    /// this safety net only catches what they missed, so with T topics a missed hint
    /// is found within T / RESCAN_CHUNK poll intervals.
    async fn rescan(&self, plan: &mut Plan, full: bool, route: Route) -> Result<(), StoreError> {
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
            topics.retain(|topic| self.mine(route, topic));
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

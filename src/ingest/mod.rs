//! Stage 1: commands in. Consumes the commands queue, applies each command to the
//! store, then acks. Invalid commands are set aside (publisher-confirmed) to the
//! invalid exchange with their reason before they are acked; nothing is dropped.
//!
//! Order: deliveries are applied in delivery order, in pipelined batches, and acked
//! with one cumulative ack once the batch and every batch before it were applied. Two
//! batches may be in Redis at once only if they name disjoint jobs, so commands on one
//! job apply in delivery order. A crash before the ack makes the broker redeliver the
//! batches, which re-applies them in the same order, so a delete that followed a put
//! still wins. Replies and set-asides go out in batch order too.
//!
//! Fencing: with a single active consumer, every put and delete carries the session's
//! ingest epoch (the `epoch` of `Store::apply_batch`), so a request this bridge gave up on, still on
//! its way to Redis while the broker redelivered its commands to another bridge,
//! cannot land after the commands that followed it. A fenced reply ends the session.
//!
//! Replicas: with `redis.wait_replicas` > 0 a batch also counts as applied only once
//! that many replicas confirmed its writes (`WAIT`, in the same round trip as the
//! writes); until then it is held unacked and the wait is asked again (see
//! [`Ingest::until_replicated`]). Re-applying a held batch after a batch behind it is
//! safe for the same reason two batches may be in flight: they name disjoint jobs.

mod decode;
mod job_url;
mod partitions;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::Acker;
use lapin::{BasicProperties, Channel, Connection, PublisherConfirm};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, headers, AmqpError};
use crate::config::Config;
use crate::feed::{Event, Feed};
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::store::PutStatus;
use crate::store::{
    Applied, Command, DueHints, Op, RejectCode, Rejection, Replication, Store, StoreError,
};
pub use decode::{decode, decode_parts, Decoded, Invalid, Rules};
use partitions::{Lane, DRAIN_IDLE, HANDOVER_FORCE, HANDOVER_QUIET};

#[derive(Debug)]
pub struct Ingest {
    pub store: Store,
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub feed: Feed,
    pub hints: Arc<DueHints>,
    /// Invalid commands are counted exactly in metrics; the log gets the first of each
    /// topic and a summary per window, not one line per command.
    pub warnings: Arc<LogThrottle>,
    /// Whether a message the client library cannot parse is being isolated.
    pub isolation: Isolation,
}

/// A message lapin cannot parse (a `message_id` that is not UTF-8, say) ends the AMQP
/// connection before the bridge sees it, and every unacked delivery goes back to the
/// queue with one more delivery counted: with the normal prefetch, a whole window of
/// valid commands would reach the queue's delivery limit along with it. So after such
/// an end, sessions consume *one command at a time* (prefetch 1, each acked once
/// applied): then only the unparseable message is unacked when the connection ends, and
/// only its count grows until the broker dead-letters it at `amqp.delivery_limit`.
#[derive(Debug, Default)]
pub struct Isolation {
    careful: std::sync::atomic::AtomicBool,
    /// Sessions ended by an unparseable message since isolation began.
    ended: std::sync::atomic::AtomicU32,
}

/// A careful session returns to the normal prefetch once nothing arrived for this long
/// with nothing in hand (the queue is empty: no unparseable message is left in it) ...
const ISOLATION_IDLE: Duration = Duration::from_millis(500);
// ... or once it applied a full normal window of commands one by one: quorum queues
// redeliver returned messages before newer ones, so by then every command the failed
// window returned was acked, and a valid command gains at most one delivery per
// unparseable message met at the normal prefetch.

/// Batches sent to Redis before the first of them came back: the next batch is applied
/// while the previous one is still in Redis or being acked, which hides a round trip
/// per batch. Two suffice to keep Redis busy; more only add unacked work at a crash.
const BATCHES_IN_FLIGHT: usize = 2;

/// A job a command names, as a hash of its topic and id: batches in flight together
/// name disjoint jobs, so commands on one job apply in delivery order, whatever order
/// the batches finish in. Taken from the delivery's borrowed fields (no allocation per
/// delivery); two jobs whose hashes collide only make a batch wait for the other, which
/// is what a shared job would do, so a collision costs time, never order.
type JobKey = u64;

fn job_key(delivery: &Delivery) -> Option<JobKey> {
    use std::hash::Hasher;
    let props = &delivery.properties;
    // As `amqp::job_id`: message_id, else the x-redisched-id text header (a command
    // with neither, or a non-text header, is invalid and names no job).
    let id: &[u8] = match props.message_id() {
        Some(id) => id.as_str().as_bytes(),
        None => match props
            .headers()
            .as_ref()
            .and_then(|t| t.inner().get(headers::ID))
        {
            Some(AMQPValue::LongString(s)) => s.as_bytes(),
            Some(AMQPValue::ShortString(s)) => s.as_str().as_bytes(),
            _ => return None,
        },
    };
    // Fixed keys: the same job must hash the same in every batch.
    let mut hasher = std::hash::DefaultHasher::new();
    hasher.write(delivery.routing_key.as_str().as_bytes());
    hasher.write_u8(0xff);
    hasher.write(id);
    Some(hasher.finish())
}

/// What a batch in flight names: its jobs (sorted, without duplicates), or everything
/// (a `delete-prefix`, whose jobs are only known once it ran, so nothing may run
/// beside it).
struct Named {
    jobs: Vec<JobKey>,
    barrier: bool,
}

impl Named {
    fn jobs(mut jobs: Vec<JobKey>) -> Self {
        jobs.sort_unstable();
        jobs.dedup();
        Self {
            jobs,
            barrier: false,
        }
    }

    fn barrier() -> Self {
        Self {
            jobs: Vec::new(),
            barrier: true,
        }
    }

    fn conflicts(&self, other: &Named) -> bool {
        if self.barrier || other.barrier {
            return true;
        }
        // Both sorted: one merge walk.
        let (mut a, mut b) = (self.jobs.iter().peekable(), other.jobs.iter().peekable());
        while let (Some(x), Some(y)) = (a.peek(), b.peek()) {
            match x.cmp(y) {
                std::cmp::Ordering::Less => {
                    a.next();
                }
                std::cmp::Ordering::Greater => {
                    b.next();
                }
                std::cmp::Ordering::Equal => return true,
            }
        }
        false
    }
}

/// An ingest session's epoch (see `Store::apply_batch`): the session part comes from
/// the store's counter at the first batch, when this consumer became the active one, so
/// it is newer than every session active before; the attempt part grows after each
/// failed apply, so the retry outranks a request of this session still on its way, but
/// never a later session (a stale session's retries stay below the session that took
/// over its commands).
#[derive(Default)]
struct Epoch(tokio::sync::Mutex<Option<(u64, u64)>>);

/// Attempts per session before the session part must change (then it takes a new one).
const EPOCH_ATTEMPTS: u64 = 1_000_000;

impl Epoch {
    async fn get(&self, store: &Store) -> Result<u64, StoreError> {
        let mut current = self.0.lock().await;
        let (session, attempt) = match *current {
            Some(parts) if parts.1 < EPOCH_ATTEMPTS => parts,
            _ => (store.next_ingest_epoch().await?, 0),
        };
        *current = Some((session, attempt));
        Ok(session * EPOCH_ATTEMPTS + attempt)
    }

    /// After an apply with `used` failed: the next one writes with a higher attempt.
    async fn expire(&self, used: u64) {
        let mut current = self.0.lock().await;
        if let Some((session, attempt)) = current.as_mut() {
            if *session * EPOCH_ATTEMPTS + *attempt == used {
                *attempt += 1;
            }
        }
    }
}

/// A batch as applied: its deliveries, for each whether it decoded (or why it is
/// invalid), the valid ones' commands and the store's result for each, in order.
struct AppliedBatch {
    batch: Vec<Delivery>,
    commands: Vec<Result<(), Invalid>>,
    /// The valid commands, in order: moved here, not cloned, from the decoded batch.
    ops: Vec<Command>,
    results: Vec<Result<Applied, Rejection>>,
    /// A `delete-prefix` batch (its one delivery): how many jobs went, or why not.
    prefix: Option<Result<u64, Invalid>>,
}

/// How one delivery ended, before it is acked.
enum Outcome {
    Applied(Applied),
    /// A `delete-prefix` removed this many jobs.
    PrefixDeleted(u64),
    Invalid(String),
}

impl Ingest {
    /// Consumes until `shutdown` or a broker error. On shutdown no more deliveries are
    /// taken and the batches in hand are finished and acked; prefetched deliveries that
    /// were not started go back to the queue when the channel closes (no `basic.cancel`
    /// first, see [`Ingest::consume`]).
    ///
    /// First the commands queues of another topology (`amqp.command_partitions`
    /// changed) are drained: unbound, consumed until empty and deleted, before any queue
    /// of this one is consumed (see [`Ingest::previous_topology`]). Then one lane per
    /// queue: the commands queue, or each of the command partitions, all on this
    /// connection, each with its own channels, epoch and fence.
    pub async fn run(
        &self,
        connection: &Connection,
        shutdown: CancellationToken,
    ) -> Result<(), AmqpError> {
        let partitions = self.config.amqp.command_partitions;
        let previous = self.previous_topology(connection).await?;
        if !previous.is_empty() {
            futures_util::future::try_join_all(
                previous
                    .iter()
                    .map(|lane| self.drain(connection, &shutdown, lane)),
            )
            .await?;
            if shutdown.is_cancelled() {
                return Ok(());
            }
        }
        // One commands queue and nothing recorded: nothing to write, as always.
        if partitions > 1 || !previous.is_empty() {
            self.store
                .set_command_partitions(partitions)
                .await
                .map_err(store_error)?;
        }
        if partitions <= 1 {
            let lane = Lane {
                queue: self.config.amqp.commands_queue.clone(),
                store: self.store.clone(),
                drain: false,
                share: None,
                handed_over: Default::default(),
            };
            return self.run_lane(connection, &shutdown, &lane).await;
        }
        self.run_partitioned(connection, &shutdown, partitions)
            .await
    }

    /// One queue's lane (see [`Ingest::run`]): consumes until shutdown, a broker error,
    /// or (draining) until the queue is idle.
    async fn run_lane(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
        lane: &Lane,
    ) -> Result<(), AmqpError> {
        use std::sync::atomic::Ordering::Relaxed;
        let shutdown = shutdown.clone();
        loop {
            let careful = self.isolation.careful.load(Relaxed);
            match self.consume(connection, &shutdown, careful, lane).await {
                // The unparseable message is gone: reopen at the normal prefetch, on the
                // same connection (nothing is unacked at this point).
                Ok(true) => {
                    let ended = self.isolation.ended.swap(0, Relaxed);
                    self.isolation.careful.store(false, Relaxed);
                    tracing::info!(queue = %self.config.amqp.commands_queue, sessions_ended = ended, prefetch = self.config.ingest.prefetch, "the unparseable message is no longer at the head of the commands queue; consuming at the normal prefetch again");
                }
                Ok(false) => return Ok(()),
                Err(err) if err.is_unparseable() => {
                    self.isolate(&err);
                    return Err(err);
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// After a session ended on a message the client library cannot parse: the next
    /// sessions consume one command at a time (see [`Isolation`]). Logged once per
    /// isolation, in the operator's terms.
    fn isolate(&self, err: &AmqpError) {
        use std::sync::atomic::Ordering::Relaxed;
        let cfg = &self.config.amqp;
        let ended = self.isolation.ended.fetch_add(1, Relaxed) + 1;
        if self.isolation.careful.swap(true, Relaxed) {
            tracing::debug!(queue = %cfg.commands_queue, sessions_ended = ended, error = %err, "the unparseable message ended another session");
            return;
        }
        if cfg.quorum_queues && cfg.delivery_limit > 0 {
            tracing::warn!(queue = %cfg.commands_queue, error = %err, delivery_limit = cfg.delivery_limit, invalid_exchange = %cfg.invalid_exchange,
                "the commands queue holds a message the AMQP client cannot parse (it ended the connection); isolating it: consuming one command at a time, so the commands behind it are applied, until the broker dead-letters it to the invalid exchange after amqp.delivery_limit deliveries");
        } else {
            tracing::error!(queue = %cfg.commands_queue, error = %err,
                "the commands queue holds a message the AMQP client cannot parse (it ended the connection); this queue has no delivery limit (amqp.quorum_queues = false or amqp.delivery_limit = 0), so the broker redelivers it forever and the commands behind it wait: remove it from the queue by hand (e.g. with the management UI); consuming one command at a time meanwhile");
        }
    }

    /// One consumer on `connection` until shutdown, a broker error, or (`careful`: one
    /// command at a time) until it is safe to return to the normal prefetch (`Ok(true)`).
    #[allow(
        clippy::too_many_lines,
        reason = "one consumer session's loop: its batching, isolation and ack rules stay side by side"
    )]
    async fn consume(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
        careful: bool,
        lane: &Lane,
    ) -> Result<bool, AmqpError> {
        let shutdown = shutdown.clone();
        let (prefetch, batch_max) = if careful {
            (1, 1)
        } else {
            (self.config.ingest.prefetch, self.config.ingest.batch)
        };
        let mut applied_carefully = 0usize;
        let mut recovered = false;
        let channel = amqp::consumer_channel(connection, prefetch).await?;
        let side = amqp::confirm_channel(connection).await?;
        let tag = format!("redisched-ingest-{}", std::process::id());
        let mut consumer = channel
            .basic_consume(
                lane.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        if careful {
            tracing::info!(queue = %lane.queue, "consuming commands one at a time (isolating an unparseable message)");
        } else {
            tracing::info!(queue = %lane.queue, "consuming commands");
        }

        let epoch = Epoch::default();
        // Batches being applied, oldest first, with the jobs each names. A batch is acked
        // (cumulatively) only when it and every batch before it were applied.
        let mut in_flight = FuturesOrdered::new();
        let mut named: VecDeque<Named> = VecDeque::new();
        // A batch naming a job an in-flight batch also names waits for it; a
        // `delete-prefix` (a batch of its own) waits for all, and all wait for it.
        let mut held: Option<(Vec<Delivery>, Named)> = None;
        // A `delete-prefix` met while a batch was being filled: it starts the next one.
        let mut stashed: Option<Delivery> = None;
        let mut draining = false;
        // A partition's lane: whether it became the active consumer (a delivery came),
        // since when its partition is another bridge's share, when the last delivery came.
        let mut active = false;
        let mut shared_away_since: Option<Instant> = None;
        let mut last_delivery = Instant::now();
        let mut handing_over = false;
        // Wakes the loop when the partitions are shared out anew.
        let mut share = lane.share.as_ref().map(|(_, owned)| owned.clone());
        loop {
            if held.is_none() {
                if let Some(barrier) = stashed.take() {
                    held = Some((vec![barrier], Named::barrier()));
                }
            }
            if let Some((batch, jobs)) = held.take() {
                if named.iter().any(|earlier| earlier.conflicts(&jobs)) {
                    held = Some((batch, jobs));
                } else {
                    in_flight.push_back(self.apply_batch(
                        &lane.store,
                        &channel,
                        batch,
                        &epoch,
                        &shutdown,
                    ));
                    named.push_back(jobs);
                }
            }
            if draining && in_flight.is_empty() {
                break;
            }
            let idle = held.is_none() && in_flight.is_empty();
            if careful && idle && applied_carefully >= usize::from(self.config.ingest.prefetch) {
                recovered = true;
                break;
            }
            let shared_away = lane.shared_to_another();
            if !shared_away {
                lane.handed_over
                    .store(false, std::sync::atomic::Ordering::Relaxed);
            }
            // Not known to be active (no delivery yet) but idle: handing over costs
            // nothing, and makes way for the owner if this lane was the active one.
            let hand_over = shared_away
                && !careful
                && !draining
                && (active || !lane.handed_over.load(std::sync::atomic::Ordering::Relaxed));
            if hand_over {
                let since = *shared_away_since.get_or_insert_with(Instant::now);
                handing_over |= since.elapsed() >= HANDOVER_FORCE;
                if idle
                    && stashed.is_none()
                    && (handing_over || last_delivery.elapsed() >= HANDOVER_QUIET)
                {
                    if active {
                        tracing::info!(queue = %lane.queue, forced = handing_over, "handing this command partition over to the bridge it is shared out to");
                    }
                    lane.handed_over
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    break;
                }
            } else {
                shared_away_since = None;
                handing_over = false;
            }
            let can_take = !draining
                && !handing_over
                && held.is_none()
                && stashed.is_none()
                && in_flight.len() < BATCHES_IN_FLIGHT;
            tokio::select! {
                biased;
                // Stop taking deliveries; the batches in hand are finished and acked.
                _ = shutdown.cancelled(), if !draining => draining = true,
                Some(done) = in_flight.next() => {
                    named.pop_front();
                    match done {
                        Some(applied) => {
                            let count = applied.batch.len();
                            // In batch order: replies and set-asides keep command order.
                            if let Some(last) = self.finish(&side, applied).await? {
                                last.ack(BasicAckOptions { multiple: true }).await?;
                            }
                            applied_carefully += count;
                        }
                        // Given up (shutdown or a closed channel while Redis was
                        // unreachable, or fenced): this batch and the ones after it stay
                        // unacked and are redelivered; the session ends.
                        None => break,
                    }
                }
                next = consumer.next(), if can_take => {
                    let first = match next {
                        Some(delivery) => delivery?,
                        None => return Err(AmqpError::Broker(lapin::ErrorKind::InvalidChannelState(
                            lapin::ChannelState::Closed, "consumer cancelled by the broker").into())),
                    };
                    last_delivery = Instant::now();
                    if !active && lane.share.is_some() {
                        tracing::info!(queue = %lane.queue, "active consumer of this command partition");
                    }
                    active = true;
                    if decode::is_prefix_delete(&first.properties) {
                        held = Some((vec![first], Named::barrier()));
                        continue;
                    }
                    let mut batch = vec![first];
                    while batch.len() < batch_max {
                        match consumer.next().now_or_never() {
                            Some(Some(delivery)) => {
                                let delivery = delivery?;
                                if decode::is_prefix_delete(&delivery.properties) {
                                    stashed = Some(delivery);
                                    break;
                                }
                                batch.push(delivery);
                            }
                            _ => break,
                        }
                    }
                    let jobs = Named::jobs(batch.iter().filter_map(job_key).collect());
                    held = Some((batch, jobs));
                }
                // Careful, and nothing came with nothing in hand: the queue is empty.
                _ = tokio::time::sleep(ISOLATION_IDLE), if careful && idle && !draining => {
                    recovered = true;
                    break;
                }
                // Draining a previous topology's queue: nothing came for a while with
                // nothing in hand, so it is empty (or another bridge is its active
                // consumer); [`Ingest::drain`] looks again.
                _ = tokio::time::sleep(DRAIN_IDLE), if lane.drain && !careful && idle && !draining => break,
                // Shared out to another bridge: look again once it may be quiet enough.
                _ = tokio::time::sleep(HANDOVER_QUIET), if hand_over && idle => {}
                Ok(()) = async {
                    match share.as_mut() {
                        Some(owned) => owned.changed().await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
        // Best effort and bounded: the connection may already be gone or hung, and
        // unacked deliveries are requeued by the broker either way. No basic.cancel
        // first: with a single active consumer, the cancel makes the next bridge active
        // while this channel still holds prefetched commands, so that bridge would get
        // the commands behind them first (found by tests/chaos.rs: a SIGTERM reordered a
        // job's replaces). Closing the channel returns them and hands over in one step.
        amqp::close_quietly("ingest channels", async {
            channel.close(200, "shutdown".into()).await.ok();
            side.close(200, "shutdown".into()).await.ok();
        })
        .await;
        Ok(recovered && !shutdown.is_cancelled())
    }

    /// Decodes and applies a batch; several may run at once. `None`: shutdown came, or
    /// the consumer channel closed, while Redis was unreachable, or the session was
    /// superseded (fenced); the batch stays unacked and is redelivered.
    async fn apply_batch(
        &self,
        store: &Store,
        channel: &Channel,
        batch: Vec<Delivery>,
        epoch: &Epoch,
        shutdown: &CancellationToken,
    ) -> Option<AppliedBatch> {
        if let [delivery] = batch.as_slice() {
            if decode::is_prefix_delete(&delivery.properties) {
                let prefix = self
                    .apply_prefix(store, channel, delivery, epoch, shutdown)
                    .await?;
                return Some(AppliedBatch {
                    batch,
                    commands: Vec::new(),
                    ops: Vec::new(),
                    results: Vec::new(),
                    prefix: Some(prefix),
                });
            }
        }
        let rules = Rules {
            limits: store.limits(),
            min_interval_ms: self.config.limits.min_interval_ms,
        };
        let targets = &self.config.targets;
        let decoded: Vec<Result<Decoded, Invalid>> = batch
            .iter()
            .map(|d| decode(d, rules).and_then(|c| job_url::check(c, &d.properties, targets)))
            .collect();
        // A cron series' first occurrence is computed on the Redis server's clock, the
        // one every due time refers to: one TIME call for a batch that has any.
        let needs_now = decoded
            .iter()
            .any(|d| d.as_ref().is_ok_and(Decoded::needs_now));
        let now = if needs_now {
            self.until_done(shutdown, channel, || store.server_time())
                .await?
        } else {
            0
        };
        let mut ops: Vec<Command> = Vec::with_capacity(decoded.len());
        let commands: Vec<Result<(), Invalid>> = decoded
            .into_iter()
            .map(|d| d.and_then(|d| d.resolve(now)).map(|c| ops.push(c)))
            .collect();
        let sent = Instant::now();
        let (results, replication) = self
            .until_done(shutdown, channel, || {
                self.apply(store, channel, &ops, epoch)
            })
            .await
            .flatten()?;
        if let Some(fenced) = first_fenced(&results) {
            // Another bridge took over these commands' topics (our deliveries went back
            // to the broker): end the session, acking nothing; what this batch applied
            // is applied again, in order, wherever the broker redelivers it.
            tracing::warn!(reason = %fenced, "this ingest session was superseded; reconnecting");
            return None;
        }
        if !self
            .until_replicated(store, channel, &ops, epoch, replication, sent, shutdown)
            .await
        {
            return None;
        }
        Some(AppliedBatch {
            batch,
            commands,
            ops,
            results,
            prefix: None,
        })
    }

    /// Applies a `delete-prefix` alone (every batch before it is acked, none after it
    /// started), fenced like puts and deletes. `None` as for [`Ingest::apply_batch`].
    async fn apply_prefix(
        &self,
        store: &Store,
        channel: &Channel,
        delivery: &Delivery,
        epoch: &Epoch,
        shutdown: &CancellationToken,
    ) -> Option<Result<u64, Invalid>> {
        let (topic, prefix) = match decode::decode_prefix_delete(delivery) {
            Ok(command) => command,
            Err(invalid) => return Some(Err(invalid)),
        };
        let fenced = self.config.amqp.single_active_consumer;
        let outcome = self
            .until_done(shutdown, channel, || async {
                let used = if fenced {
                    Some(epoch.get(store).await?)
                } else {
                    None
                };
                if used.is_some() && !still_ours(channel) {
                    return Ok(None);
                }
                match store.delete_prefix(&topic, &prefix, used).await {
                    Ok(n) => Ok(Some(Ok(n))),
                    Err(StoreError::Rejected(rejection)) => Ok(Some(Err(rejection))),
                    Err(err) => {
                        if let Some(used) = used {
                            epoch.expire(used).await;
                        }
                        Err(err)
                    }
                }
            })
            .await
            .flatten()?;
        match outcome {
            Ok(n) => {
                tracing::info!(%topic, id_prefix = %prefix, deleted = n, "jobs cancelled by id prefix");
                Some(Ok(n))
            }
            Err(rejection) if rejection.code == RejectCode::Fenced => {
                tracing::warn!(reason = %rejection, "this ingest session was superseded; reconnecting");
                None
            }
            Err(rejection) => Some(Err(Invalid(rejection.to_string()))),
        }
    }

    /// Reports an applied batch (metrics, feed, replies) and sets its invalid commands
    /// aside, confirmed; returns the acker of its last delivery. Called in batch order.
    async fn finish(
        &self,
        side: &Channel,
        applied: AppliedBatch,
    ) -> Result<Option<Acker>, AmqpError> {
        let AppliedBatch {
            batch,
            commands,
            ops,
            mut results,
            prefix,
        } = applied;
        let mut ops = ops.into_iter();
        results.reverse();
        let outcomes: Vec<Outcome> = match prefix {
            // A delete-prefix batch holds that one delivery.
            Some(Ok(deleted)) => vec![Outcome::PrefixDeleted(deleted)],
            Some(Err(invalid)) => vec![Outcome::Invalid(invalid.0)],
            None => commands
                .into_iter()
                .map(|command| match command {
                    Err(invalid) => Outcome::Invalid(invalid.0),
                    Ok(()) => match (ops.next(), results.pop()) {
                        (Some(command), Some(Ok(done))) => {
                            self.after_applied(&command.op, done);
                            Outcome::Applied(done)
                        }
                        (_, Some(Err(rejection))) => Outcome::Invalid(rejection.to_string()),
                        _ => Outcome::Invalid("internal: no result for this command".into()),
                    },
                })
                .collect(),
        };
        let mut set_aside: Vec<PublisherConfirm> = Vec::new();
        for (delivery, outcome) in batch.iter().zip(outcomes) {
            self.record(delivery, &outcome);
            self.reply(side, delivery, &outcome).await;
            if let Outcome::Invalid(reason) = &outcome {
                if self.warnings.admit(
                    delivery.routing_key.as_str(),
                    "invalid commands set aside",
                    reason,
                ) {
                    tracing::warn!(topic = %delivery.routing_key, id = ?amqp::job_id(&delivery.properties).ok().flatten(), %reason, "invalid command set aside");
                }
                set_aside.push(self.set_aside(side, delivery, reason).await?);
            }
        }
        for confirm in set_aside {
            match confirm.await? {
                lapin::Confirmation::Ack(None) => {}
                _ => {
                    return Err(AmqpError::NotConfirmed {
                        exchange: self.config.amqp.invalid_exchange.clone(),
                    })
                }
            }
        }
        Ok(batch.last().map(|last| last.acker.clone()))
    }

    /// Applies commands, fenced by the session's epoch while the commands queue has a
    /// single active consumer (with several active consumers order is not promised,
    /// and they would fence each other); with `redis.wait_replicas`, says what the
    /// replicas confirmed.
    ///
    /// `Ok(None)`: not applied, because `channel` closed while the epoch was taken.
    async fn apply(
        &self,
        store: &Store,
        channel: &Channel,
        ops: &[Command],
        epoch: &Epoch,
    ) -> Result<Option<(Vec<Result<Applied, Rejection>>, Replication)>, StoreError> {
        if !self.config.amqp.single_active_consumer {
            return store.apply_batch(ops, None).await.map(Some);
        }
        let used = epoch.get(store).await?;
        if !still_ours(channel) {
            return Ok(None);
        }
        let result = store.apply_batch(ops, Some(used)).await;
        if result.is_err() {
            // The request may still reach Redis later over the old connection: the
            // retry writes with a newer epoch, so that late arrival is refused.
            epoch.expire(used).await;
        }
        result.map(Some)
    }

    /// Retries a store call while Redis is unreachable: a command is never acked before
    /// it was applied, so an outage stalls intake instead of losing commands. `None` on
    /// shutdown, or once `channel` (the one the batch came on) is closed: the broker has
    /// taken the batch back and may have given it to another bridge, which may have
    /// applied it and the commands after it, so applying it here now could undo a later
    /// delete or replace (found by `tests/chaos.rs`; `tests/faults.rs`,
    /// `a_bridge_that_lost_its_batch_does_not_apply_it_later`).
    async fn until_done<T, F, Fut>(
        &self,
        shutdown: &CancellationToken,
        channel: &Channel,
        mut call: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut backoff = Duration::from_millis(100);
        loop {
            if !channel.status().connected() {
                tracing::warn!("commands channel closed while Redis was unavailable; the broker redelivers the batch, it is not applied here");
                return None;
            }
            match call().await {
                Ok(results) => {
                    return Some(results);
                }
                Err(err) => {
                    let level_error = !matches!(
                        err,
                        StoreError::Unavailable(_) | StoreError::NotReplicated { .. }
                    );
                    if level_error {
                        tracing::error!(error = %err, "store failed a command batch; retrying");
                    } else {
                        tracing::warn!(error = %err, retry_in = ?backoff, "redis unavailable; commands wait");
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Holds an applied batch, unacked, until `redis.wait_replicas` replicas confirmed
    /// its writes: asks again after a pause (the `WAIT` itself blocks up to
    /// `redis.wait_timeout_ms`), and applies the batch again, in order, when the
    /// connection that wrote it was replaced (the outcomes of the first application stand).
    /// Never nacks: a requeued command counts towards the queue's delivery limit and
    /// would be dead-lettered while valid. `false` on shutdown, once `channel` closed (the
    /// broker took the batch back: see [`Ingest::until_done`]), or when the re-applied
    /// batch was fenced: the batch stays unacked and is redelivered.
    #[allow(clippy::too_many_arguments)]
    async fn until_replicated(
        &self,
        store: &Store,
        channel: &Channel,
        commands: &[Command],
        epoch: &Epoch,
        mut replication: Replication,
        sent: Instant,
        shutdown: &CancellationToken,
    ) -> bool {
        let (wanted, timeout_ms) = (
            self.config.redis.wait_replicas,
            self.config.redis.wait_timeout_ms,
        );
        let mut pause = Duration::from_millis(100);
        let mut held = false;
        loop {
            let mark = match replication {
                Replication::NotAsked => return true,
                Replication::Confirmed { replicas } => {
                    self.metrics
                        .replication_wait
                        .observe(sent.elapsed().as_secs_f64());
                    if held {
                        tracing::info!(replicas, waited = ?sent.elapsed(), "replicas confirmed the held command batch; acking it");
                    }
                    return true;
                }
                Replication::Short { replicas, mark } => {
                    self.metrics.replication_shortfall("timeout");
                    let detail =
                        format!("{replicas} of {wanted} replicas confirmed within {timeout_ms} ms");
                    if self
                        .warnings
                        .admit("*", "command batches held for replicas", &detail)
                    {
                        tracing::warn!(replicas, wanted, timeout_ms, "command batch applied but not acked: too few replicas confirmed it (redis.wait_replicas); holding it and asking again");
                    }
                    Some(mark)
                }
                Replication::Replaced => {
                    self.metrics.replication_shortfall("connection_replaced");
                    tracing::warn!("the Redis connection that wrote the held command batch was replaced; applying the batch again before waiting");
                    None
                }
            };
            held = true;
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(1));
            let next = match &mark {
                Some(mark) => {
                    self.until_done(shutdown, channel, || store.wait_durable(mark))
                        .await
                }
                None => match self
                    .until_done(shutdown, channel, || {
                        self.apply(store, channel, commands, epoch)
                    })
                    .await
                    .flatten()
                {
                    Some((results, _)) if first_fenced(&results).is_some() => {
                        tracing::warn!("this ingest session was superseded while its batch waited for replicas; reconnecting");
                        return false;
                    }
                    applied => applied.map(|(_, replication)| replication),
                },
            };
            let Some(next) = next else {
                return false;
            };
            replication = next;
        }
    }

    fn after_applied(&self, op: &Op, applied: Applied) {
        if let (Op::Put(put), Applied::Put(outcome)) = (op, applied) {
            if outcome.status != PutStatus::Duplicate {
                self.hints.hint(&put.topic, outcome.due_at);
            }
        }
    }

    fn record(&self, delivery: &Delivery, outcome: &Outcome) {
        let op = decode::op_name(&delivery.properties);
        let outcome_name = outcome_name(outcome);
        self.metrics.command(op, outcome_name);
        if matches!(outcome, Outcome::Invalid(_)) {
            self.metrics.invalid_commands.inc();
        }
        self.feed.send_with(|| Event::Command {
            topic: delivery.routing_key.to_string(),
            id: amqp::job_id(&delivery.properties)
                .ok()
                .flatten()
                .unwrap_or_default(),
            op: op.into(),
            outcome: outcome_name.into(),
        });
    }

    /// Answers on `reply_to` when the producer asked. Best effort: a lost reply does not
    /// undo the command, so it is not awaited.
    async fn reply(&self, side: &Channel, delivery: &Delivery, outcome: &Outcome) {
        let Some(reply_to) = delivery.properties.reply_to() else {
            return;
        };
        let mut body = json!({
            "status": outcome_name(outcome),
            "topic": delivery.routing_key.as_str(),
            "id": amqp::job_id(&delivery.properties).ok().flatten(),
        });
        match outcome {
            Outcome::Applied(Applied::Put(put)) => body["due_at"] = json!(put.due_at),
            Outcome::Invalid(reason) => body["error"] = json!(reason),
            Outcome::PrefixDeleted(n) => body["deleted"] = json!(n),
            Outcome::Applied(Applied::Delete { .. }) => {}
        }
        let mut props = BasicProperties::default().with_content_type("application/json".into());
        if let Some(correlation) = delivery.properties.correlation_id() {
            props = props.with_correlation_id(correlation.clone());
        }
        let published = side
            .basic_publish(
                "".into(),
                reply_to.clone(),
                BasicPublishOptions::default(),
                body.to_string().as_bytes(),
                props,
            )
            .await;
        if let Err(err) = published {
            tracing::warn!(error = %err, reply_to = %reply_to, "could not send reply");
        }
    }

    /// Republishes a command, body and properties intact, to the invalid exchange with
    /// its reason. Mandatory: if the invalid queue is gone the publish is returned, the
    /// command is not acked, and the session restarts and re-declares the queue.
    async fn set_aside(
        &self,
        side: &Channel,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<PublisherConfirm, AmqpError> {
        let mut table = delivery.properties.headers().clone().unwrap_or_default();
        table.insert(
            headers::ERROR.into(),
            AMQPValue::LongString(LongString::from(reason.as_bytes().to_vec())),
        );
        let props = delivery.properties.clone().with_headers(table);
        Ok(side
            .basic_publish(
                self.config.amqp.invalid_exchange.as_str().into(),
                delivery.routing_key.clone(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                props,
            )
            .await?)
    }
}

/// A store call ingest needs before it consumes (the recorded partition count) failed:
/// the session ends and is started again after the usual backoff.
fn store_error(err: StoreError) -> AmqpError {
    AmqpError::Topology(format!(
        "cannot read or record the command partition count in Redis: {err}"
    ))
}

/// Whether `channel`, the one a batch came on, is still open. Checked again after the
/// session's epoch was taken, because taking it is a Redis round trip that a slow link
/// can stretch: had the broker given the batch to another bridge meanwhile, that bridge
/// may have applied it and later commands with an *older* epoch (it became active before
/// this epoch was issued), and this batch, written with the newer one, would win over
/// them (found by `tests/chaos.rs` with command partitions: a replace lost).
fn still_ours(channel: &Channel) -> bool {
    channel.status().connected()
}

/// The first command of a batch refused because a newer ingest epoch wrote its topic.
fn first_fenced(results: &[Result<Applied, Rejection>]) -> Option<&Rejection> {
    results.iter().find_map(|result| match result {
        Err(rejection) if rejection.code == RejectCode::Fenced => Some(rejection),
        _ => None,
    })
}

fn outcome_name(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Applied(Applied::Put(put)) => put.status.as_str(),
        Outcome::Applied(Applied::Delete { removed: true }) => "deleted",
        Outcome::Applied(Applied::Delete { removed: false }) => "not_found",
        Outcome::PrefixDeleted(0) => "not_found",
        Outcome::PrefixDeleted(_) => "deleted",
        Outcome::Invalid(_) => "invalid",
    }
}

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
//! ingest epoch (the `epoch` of the store's batch apply), so a request this bridge gave
//! up on, still on its way to Redis while the broker redelivered its commands to another
//! bridge, cannot land after the commands that followed it. A fenced reply ends the
//! session.
//!
//! Replicas: with `redis.wait_replicas` > 0 a batch also counts as applied only once
//! that many replicas confirmed its writes (`WAIT`, in the same round trip as the
//! writes); until then it is held unacked and the wait is asked again (see
//! `Ingest::until_replicated`). Re-applying a held batch after a batch behind it is
//! safe for the same reason two batches may be in flight: they name disjoint jobs.
//!
//! The rooms: `decode.rs` turns a delivery into a command once (a job's own URL checked
//! by `crate::targets`, the SSRF guard); `route.rs` the router of partitioned commands;
//! `session.rs` runs one consumer session (batching, epoch, acks);
//! `batch.rs` applies a batch to the store (fenced, retried, held for replicas);
//! `reply.rs` reports each command (metrics, feed, reply) and sets invalid ones aside;
//! `partitions.rs` runs one lane per command partition and drains an old topology.

mod batch;
mod decode;
mod partitions;
mod reply;
mod route;
mod session;

use std::sync::Arc;
use std::time::Duration;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpError};
use crate::config::Config;
use crate::feed::Feed;
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::store::{DueHints, Store, StoreError};
pub use decode::{decode_parts, Decoded, Invalid, Rules};
use partitions::Lane;
pub use route::{route_commands, Routed};

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
    /// Whether a message the client library cannot parse is being isolated: one flag
    /// for every consumer on the connection (the lanes and, partitioned, the router),
    /// since lapin does not say whose delivery ended it.
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

/// A careful session looks at its queue once nothing came for this long with nothing in
/// hand ...
const ISOLATION_IDLE: Duration = Duration::from_millis(500);
/// ... and returns to the full window once this many looks in a row found no ready
/// message in it. Silence alone is not an empty queue: a loaded broker may take longer
/// to redeliver the unparseable message, and a full window taken with it still at the
/// head would count one more delivery against every valid command behind it (found by
/// the deep-headers poison test under CI's load: the valid commands reached the
/// delivery limit).
const EMPTY_LOOKS: u8 = 2;

/// A careful session's looks at its queue: after [`ISOLATION_IDLE`] of silence, is it
/// empty?
#[derive(Debug, Default)]
struct EmptyLooks(u8);

impl EmptyLooks {
    /// A delivery came: the queue was not empty.
    fn delivered(&mut self) {
        self.0 = 0;
    }

    /// Looks once; whether the broker found no ready message [`EMPTY_LOOKS`] looks in
    /// a row, so the session may return to the full window.
    async fn look(&mut self, connection: &Connection, queue: &str) -> Result<bool, AmqpError> {
        let state = amqp::queue_state(connection, queue).await?;
        self.0 = if state.is_none_or(|(ready, _)| ready == 0) {
            self.0.saturating_add(1)
        } else {
            0
        };
        Ok(self.0 >= EMPTY_LOOKS)
    }
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
        // Stage by stage: a routed topology's partitions hold older commands than
        // its route queue, so they are drained first.
        for stage in &previous {
            futures_util::future::try_join_all(
                stage
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
                    tracing::info!(queue = %lane.queue, sessions_ended = ended, prefetch = self.config.ingest.prefetch, "the unparseable message is no longer at the head of the commands queue; consuming at the normal prefetch again");
                }
                Ok(false) => return Ok(()),
                Err(err) if err.is_unparseable() => {
                    self.isolate(&lane.queue, &err);
                    return Err(err);
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// After a session ended on a message the client library cannot parse: the next
    /// sessions consume one command at a time (see [`Isolation`]). Partitioned, the
    /// router and every lane go careful, as they share the connection (a lane whose
    /// queue is empty returns to the full window after two looks; marking only the
    /// consumer whose error came first left the router at the full window when the
    /// message was in the route queue). Logged once per isolation, in the operator's
    /// terms.
    fn isolate(&self, queue: &str, err: &AmqpError) {
        use std::sync::atomic::Ordering::Relaxed;
        let cfg = &self.config.amqp;
        let ended = self.isolation.ended.fetch_add(1, Relaxed) + 1;
        let queue = if cfg.command_partitions > 1 {
            format!("{} or one of its partitions", amqp::route_queue(cfg))
        } else {
            queue.to_string()
        };
        let queue = queue.as_str();
        if self.isolation.careful.swap(true, Relaxed) {
            tracing::debug!(queue, sessions_ended = ended, error = %err, "the unparseable message ended another session");
            return;
        }
        if cfg.quorum_queues && cfg.delivery_limit > 0 {
            tracing::warn!(queue, error = %err, delivery_limit = cfg.delivery_limit, invalid_exchange = %cfg.invalid_exchange,
                "a commands queue holds a message the AMQP client cannot parse (it ended the connection); isolating it: consuming one command at a time, so the commands behind it are applied, until the broker dead-letters it to the invalid exchange after amqp.delivery_limit deliveries");
        } else {
            tracing::error!(queue, error = %err,
                "a commands queue holds a message the AMQP client cannot parse (it ended the connection); this queue has no delivery limit (amqp.quorum_queues = false or amqp.delivery_limit = 0), so the broker redelivers it forever and the commands behind it wait: remove it from the queue by hand (e.g. with the management UI); consuming one command at a time meanwhile");
        }
    }
}

/// A store call ingest needs before it consumes (the recorded partition count) failed:
/// the session ends and is started again after the usual backoff.
fn store_error(err: StoreError) -> AmqpError {
    AmqpError::Topology(format!(
        "cannot read or record the command partition count in Redis: {err}"
    ))
}

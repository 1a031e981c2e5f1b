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
//! `Apply::until_replicated`). Re-applying a held batch after a batch behind it is
//! safe for the same reason two batches may be in flight: they name disjoint jobs.
//!
//! The rooms, in the order a command meets them: [`Ingest::run`] here starts one lane
//! per commands queue (`lane.rs`: a queue, its store and fence, when its session ends
//! of itself) and runs its sessions one after another, careful after an unparseable
//! message (`isolation.rs`); `session.rs` one consumer session, step by step (take a
//! batch, apply it, answer it, hand the partition over); `decode/` what a delivery
//! names as it is taken, and its command, decoded once as its batch is applied;
//! `batch.rs` applies a batch (the Redis clock read first if it has a cron series,
//! fenced, retried, held for replicas); `reply.rs` answers it (metrics, feed, replies,
//! set-asides) and acks it. Partitioned commands: `partitions.rs` (a lane per
//! partition, the share-out among bridges, the drain of a previous topology) and
//! `route.rs` (the router, careful too after an unparseable message).

mod batch;
mod decode;
mod isolation;
mod lane;
mod partitions;
mod reply;
mod route;
mod session;

use std::sync::Arc;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use crate::amqp::AmqpError;
use crate::config::Config;
use crate::feed::Feed;
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::store::{DueHints, Store, StoreError};
pub use decode::{decode_parts, needs_clock, Invalid, Rules};
pub use isolation::Isolation;
use lane::Lane;
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

impl Ingest {
    /// Consumes until `shutdown` or a broker error. On shutdown no more deliveries are
    /// taken and the batches in hand are finished and acked; prefetched deliveries that
    /// were not started go back to the queue when the channel closes (no `basic.cancel`
    /// first, see `session.rs`).
    ///
    /// First the commands queues of another topology (`amqp.command_partitions`
    /// changed) are drained: unbound, consumed until empty and deleted, before any queue
    /// of this one is consumed (see `Ingest::previous_topology`). Then one lane per
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
            let lane = Lane::new(self.config.amqp.commands_queue.clone(), self.store.clone());
            return self.run_lane(connection, &shutdown, &lane).await;
        }
        self.run_partitioned(connection, &shutdown, partitions)
            .await
    }

    /// One queue's lane: its sessions one after another, until shutdown, a broker
    /// error, or (draining) until the queue is idle. After a session ended on a message
    /// the client library cannot parse, the next ones are careful (`isolation.rs`).
    async fn run_lane(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
        lane: &Lane,
    ) -> Result<(), AmqpError> {
        loop {
            let careful = self.isolation.careful();
            match self.consume(connection, shutdown, careful, lane).await {
                // The unparseable message is gone: reopen at the normal prefetch, on the
                // same connection (nothing is unacked at this point).
                Ok(true) => {
                    let ended = self.isolation.recovered();
                    tracing::info!(queue = %lane.queue, sessions_ended = ended, prefetch = self.config.ingest.prefetch, "the unparseable message is no longer at the head of the commands queue; consuming at the normal prefetch again");
                }
                Ok(false) => return Ok(()),
                Err(err) if err.is_unparseable() => {
                    self.isolation.isolate(&self.config.amqp, &lane.queue, &err);
                    return Err(err);
                }
                Err(err) => return Err(err),
            }
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

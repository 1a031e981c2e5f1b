//! One consumer session of a lane: its channels and consumer, taking deliveries into
//! batches (each decoded as it is taken), at most [`BATCHES_IN_FLIGHT`] batches naming
//! disjoint jobs in Redis at once, cumulative acks in batch order (each session with its
//! own ingest epoch, `batch.rs`), and the hand-over of a partition shared out to another
//! bridge.

use std::collections::VecDeque;
use std::time::Instant;

use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::FieldTable;
use lapin::Connection;
use tokio_util::sync::CancellationToken;

use super::batch::{Epoch, Named, Received};
use super::decode::{decode, Rules};
use super::partitions::{Lane, DRAIN_IDLE, HANDOVER_FORCE, HANDOVER_QUIET};
use super::{EmptyLooks, Ingest, ISOLATION_IDLE};
use crate::amqp::{self, AmqpError};

// A careful session returns to the normal prefetch once its queue is empty (no
// unparseable message is left in it: `super::EmptyLooks`), or once it applied a full
// normal window of commands one by one: quorum queues redeliver returned messages
// before newer ones, so by then every command the failed window returned was acked, and
// a valid command gains at most one delivery per unparseable message met at the normal
// prefetch.

/// Batches sent to Redis before the first of them came back: the next batch is applied
/// while the previous one is still in Redis or being acked, which hides a round trip
/// per batch. Two suffice to keep Redis busy; more only add unacked work at a crash.
const BATCHES_IN_FLIGHT: usize = 2;

impl Ingest {
    /// One consumer on `connection` until shutdown, a broker error, or (`careful`: one
    /// command at a time) until it is safe to return to the normal prefetch (`Ok(true)`).
    #[allow(
        clippy::too_many_lines,
        reason = "one consumer session's loop: its batching, isolation and ack rules stay side by side"
    )]
    pub(super) async fn consume(
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
        let mut looks = EmptyLooks::default();
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

        let rules = Rules {
            limits: lane.store.limits(),
            min_interval_ms: self.config.limits.min_interval_ms,
        };
        let targets = &self.config.targets;
        // Each delivery is decoded once, as it is taken; batching reads the result.
        let receive = |delivery: Delivery| Received {
            incoming: decode(&delivery, rules, targets),
            delivery,
        };
        let epoch = Epoch::default();
        // Batches being applied, oldest first, with the jobs each names. A batch is acked
        // (cumulatively) only when it and every batch before it were applied.
        let mut in_flight = FuturesOrdered::new();
        let mut named: VecDeque<Named> = VecDeque::new();
        // A batch naming a job an in-flight batch also names waits for it; a
        // `delete-prefix` (a batch of its own) waits for all, and all wait for it.
        let mut held: Option<(Vec<Received>, Named)> = None;
        // A `delete-prefix` met while a batch was being filled: it starts the next one.
        let mut stashed: Option<Received> = None;
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
                        Some(delivery) => receive(delivery?),
                        None => return Err(AmqpError::Broker(lapin::ErrorKind::InvalidChannelState(
                            lapin::ChannelState::Closed, "consumer cancelled by the broker").into())),
                    };
                    last_delivery = Instant::now();
                    looks.delivered();
                    if !active && lane.share.is_some() {
                        tracing::info!(queue = %lane.queue, "active consumer of this command partition");
                    }
                    active = true;
                    if first.is_prefix_delete() {
                        held = Some((vec![first], Named::barrier()));
                        continue;
                    }
                    let mut batch = vec![first];
                    while batch.len() < batch_max {
                        match consumer.next().now_or_never() {
                            Some(Some(delivery)) => {
                                let received = receive(delivery?);
                                if received.is_prefix_delete() {
                                    stashed = Some(received);
                                    break;
                                }
                                batch.push(received);
                            }
                            _ => break,
                        }
                    }
                    let jobs = Named::jobs(batch.iter().filter_map(Received::job_key).collect());
                    held = Some((batch, jobs));
                }
                // Careful, and nothing came with nothing in hand: is the queue empty?
                _ = tokio::time::sleep(ISOLATION_IDLE), if careful && idle && !draining => {
                    if looks.look(connection, &lane.queue).await? {
                        recovered = true;
                        break;
                    }
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
}

//! One consumer session of a lane, as a state machine read top to bottom
//! ([`Session::run`]): it opens its channels, then, until it ends, **applies** the batch
//! it took once that names no job a batch in flight names, sees whether it **ends**
//! (shutdown drained, a careful session recovered, a partition **handed over**), waits
//! for what comes next, and handles it: **answers** an applied batch (replies,
//! set-asides, the cumulative ack, in batch order), or **takes** a batch of deliveries.
//! At most [`BATCHES_IN_FLIGHT`] batches naming disjoint jobs are in Redis at once;
//! each session writes with its own ingest epoch (`batch.rs`).

use std::collections::VecDeque;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesOrdered;
use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use tokio_util::sync::CancellationToken;

use super::batch::{AppliedBatch, Apply, Epoch};
use super::decode::{JobKey, Received, Rules};
use super::isolation::{why_ended, Careful, ISOLATION_IDLE};
use super::lane::{Doing, HandOver, Lane, DRAIN_IDLE, HANDOVER_QUIET};
use super::Ingest;
use crate::amqp::{self, AmqpError};

/// Batches sent to Redis before the first of them came back: the next batch is applied
/// while the previous one is still in Redis or being acked, which hides a round trip
/// per batch. Two suffice to keep Redis busy; more only add unacked work at a crash.
const BATCHES_IN_FLIGHT: usize = 2;

/// One consumer on a lane's queue, until shutdown, a broker error, or (careful: one
/// command at a time) until it is safe to return to the normal prefetch.
pub(super) struct Session<'a> {
    ingest: &'a Ingest,
    lane: &'a Lane,
    connection: &'a Connection,
    shutdown: &'a CancellationToken,
    /// Isolating an unparseable message (see `isolation.rs`), and its way back.
    careful: Careful,
    batch_max: usize,
    channel: Channel,
    /// Replies and set-asides.
    side: Channel,
    consumer: Consumer,
    /// What the batches in flight share.
    applier: Arc<Apply<'a>>,
    /// Batches being applied, oldest first, with the jobs each names. A batch is acked
    /// (cumulatively) only when it and every batch before it were applied.
    in_flight: FuturesOrdered<BoxFuture<'a, Option<AppliedBatch>>>,
    named: VecDeque<Named>,
    /// A batch taken that names a job a batch in flight also names waits for it; a
    /// `delete-prefix` (a batch of its own) waits for all, and all wait for it.
    held: Option<(Vec<Received>, Named)>,
    /// A `delete-prefix` met while a batch was being taken: it starts the next one.
    stashed: Option<Received>,
    /// Shutdown came: no more deliveries are taken; the batches in hand are finished.
    draining: bool,
    hand_over: HandOver,
    /// Wakes the session when the partitions are shared out anew.
    share: Option<tokio::sync::watch::Receiver<Vec<bool>>>,
}

/// What the session waited for.
#[allow(
    clippy::large_enum_variant,
    reason = "returned once per wait and matched at once, never stored"
)]
enum Next {
    Shutdown,
    /// The oldest batch in flight: applied, or given up (`None`).
    Applied(Option<AppliedBatch>),
    Delivery(Option<lapin::Result<Delivery>>),
    /// Careful, and nothing came with nothing in hand for [`ISOLATION_IDLE`].
    Silence,
    /// Draining a previous topology's queue, and nothing came for [`DRAIN_IDLE`].
    Drained,
    /// The partitions were shared out anew, or a hand-over may be quiet enough now.
    LookAgain,
}

/// How a session ended without an error.
#[derive(PartialEq, Eq)]
enum Ended {
    /// Shutdown with everything in hand finished, a drained queue idle, a batch given
    /// up (shutdown or a closed channel while Redis was unreachable, or fenced: it and
    /// the ones after it stay unacked and are redelivered), or a partition handed over.
    Done,
    /// Careful, and the unparseable message is no longer at the head of the queue.
    Recovered,
}

impl Ingest {
    /// One consumer session on `lane` (see [`Session`]); `Ok(true)`: it was careful and
    /// may return to the normal prefetch.
    pub(super) async fn consume(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
        careful: bool,
        lane: &Lane,
    ) -> Result<bool, AmqpError> {
        let session = Session::open(self, connection, shutdown, careful, lane).await?;
        Ok(session.run().await? == Ended::Recovered && !shutdown.is_cancelled())
    }
}

impl<'a> Session<'a> {
    /// Opens the consumer and its side channel (replies, set-asides).
    async fn open(
        ingest: &'a Ingest,
        connection: &'a Connection,
        shutdown: &'a CancellationToken,
        careful: bool,
        lane: &'a Lane,
    ) -> Result<Self, AmqpError> {
        let config = &ingest.config;
        let (prefetch, batch_max) = if careful {
            (1, 1)
        } else {
            (config.ingest.prefetch, config.ingest.batch)
        };
        let channel = amqp::consumer_channel(connection, prefetch).await?;
        let side = amqp::confirm_channel(connection).await?;
        let tag = format!("redisched-ingest-{}", std::process::id());
        let consumer = channel
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
        let apply = Apply {
            ingest,
            store: &lane.store,
            channel: channel.clone(),
            epoch: Epoch::default(),
            rules: Rules {
                limits: lane.store.limits(),
                min_interval_ms: config.limits.min_interval_ms,
            },
            shutdown,
        };
        Ok(Self {
            ingest,
            lane,
            connection,
            shutdown,
            careful: Careful::new(careful, usize::from(config.ingest.prefetch)),
            batch_max,
            channel,
            side,
            consumer,
            applier: Arc::new(apply),
            in_flight: FuturesOrdered::new(),
            named: VecDeque::new(),
            held: None,
            stashed: None,
            draining: false,
            hand_over: HandOver::new(),
            share: lane.share.as_ref().map(|share| share.owned.clone()),
        })
    }

    /// The session, step by step, until it ends; then its channels are closed (not on
    /// an error: the connection ends with it). An end met inside a batch (its channel
    /// closed under the apply, a failed ack or set-aside) is an unparseable message's
    /// when that is what ended the connection (`isolation.rs`, [`why_ended`]).
    async fn run(mut self) -> Result<Ended, AmqpError> {
        let ended = self.steps().await;
        let ended = why_ended(ended, &self.channel, &mut self.consumer).await?;
        self.close().await;
        Ok(ended)
    }

    async fn steps(&mut self) -> Result<Ended, AmqpError> {
        loop {
            self.apply();
            let idle = self.held.is_none() && self.in_flight.is_empty();
            if let Some(ended) = self.ends(idle) {
                return Ok(ended);
            }
            match self.next(idle).await {
                Next::Shutdown => self.draining = true,
                Next::Applied(Some(applied)) => self.answer(applied).await?,
                Next::Applied(None) => return Ok(Ended::Done),
                Next::Delivery(delivery) => self.take(delivery)?,
                Next::Silence => {
                    let queue = &self.lane.queue;
                    if self.careful.queue_empty(self.connection, queue).await? {
                        return Ok(Ended::Recovered);
                    }
                }
                Next::Drained => return Ok(Ended::Done),
                Next::LookAgain => {}
            }
        }
    }

    /// Apply: the batch taken (or the `delete-prefix` put aside) goes to Redis, unless it
    /// names a job a batch in flight names (then it waits for that batch).
    fn apply(&mut self) {
        if self.held.is_none() {
            if let Some(barrier) = self.stashed.take() {
                self.held = Some((vec![barrier], Named::barrier()));
            }
        }
        let Some((batch, jobs)) = self.held.take() else {
            return;
        };
        if self.named.iter().any(|earlier| earlier.conflicts(&jobs)) {
            self.held = Some((batch, jobs));
            return;
        }
        let apply = Arc::clone(&self.applier);
        self.in_flight
            .push_back(async move { apply.batch(batch).await }.boxed());
        self.named.push_back(jobs);
    }

    /// Whether the session ends here: shutdown came and nothing is in flight; careful
    /// and a full window went through one by one; or its partition is handed over.
    fn ends(&mut self, idle: bool) -> Option<Ended> {
        if self.draining && self.in_flight.is_empty() {
            return Some(Ended::Done);
        }
        if idle && self.careful.window_done() {
            return Some(Ended::Recovered);
        }
        let doing = Doing {
            careful: self.careful.is_on(),
            draining: self.draining,
            quiet: idle && self.stashed.is_none(),
        };
        let lane = self.lane;
        self.hand_over
            .now(&lane.queue, lane.share.as_ref(), doing)
            .then_some(Ended::Done)
    }

    /// Waits for what comes first: shutdown, the oldest batch in flight, a delivery (if
    /// the session takes one now), or a reason to look again.
    async fn next(&mut self, idle: bool) -> Next {
        let can_take = !self.draining
            && !self.hand_over.forced()
            && self.held.is_none()
            && self.stashed.is_none()
            && self.in_flight.len() < BATCHES_IN_FLIGHT;
        let careful = self.careful.is_on();
        let (draining, drain) = (self.draining, self.lane.drain);
        let hand_over = self.hand_over.due();
        let shutdown = self.shutdown;
        let Session {
            in_flight,
            consumer,
            share,
            ..
        } = self;
        tokio::select! {
            biased;
            // Stop taking deliveries; the batches in hand are finished and acked.
            _ = shutdown.cancelled(), if !draining => Next::Shutdown,
            Some(done) = in_flight.next() => Next::Applied(done),
            next = consumer.next(), if can_take => Next::Delivery(next),
            // Careful, and nothing came with nothing in hand: is the queue empty?
            _ = tokio::time::sleep(ISOLATION_IDLE), if careful && idle && !draining => Next::Silence,
            // Draining a previous topology's queue: nothing came for a while with
            // nothing in hand, so it is empty (or another bridge is its active
            // consumer); `Ingest::drain` looks again.
            _ = tokio::time::sleep(DRAIN_IDLE), if drain && !careful && idle && !draining => Next::Drained,
            // Shared out to another bridge: look again once it may be quiet enough.
            _ = tokio::time::sleep(HANDOVER_QUIET), if hand_over && idle => Next::LookAgain,
            Ok(()) = async {
                match share.as_mut() {
                    Some(owned) => owned.changed().await,
                    None => std::future::pending().await,
                }
            } => Next::LookAgain,
        }
    }

    /// Answer: the oldest batch in flight was applied; its commands are answered and
    /// set aside as need be, and it is acked (`reply.rs`).
    async fn answer(&mut self, applied: AppliedBatch) -> Result<(), AmqpError> {
        self.named.pop_front();
        let count = applied.batch.len();
        // In batch order: replies and set-asides keep command order.
        self.ingest.answer(&self.side, applied).await?;
        self.careful.done(count);
        Ok(())
    }

    /// Take: the delivery that came and those already here behind it, up to a batch,
    /// each with what it names (decoded when its batch is applied). A `delete-prefix`
    /// is a batch of its own: met first, it is one; met later, it is put aside to start
    /// the next.
    fn take(&mut self, next: Option<lapin::Result<Delivery>>) -> Result<(), AmqpError> {
        let first = match next {
            Some(delivery) => Received::of(delivery?),
            None => {
                return Err(AmqpError::Broker(
                    lapin::ErrorKind::InvalidChannelState(
                        lapin::ChannelState::Closed,
                        "consumer cancelled by the broker",
                    )
                    .into(),
                ))
            }
        };
        self.hand_over
            .delivered(&self.lane.queue, self.lane.share.as_ref());
        self.careful.delivered();
        if first.is_prefix_delete() {
            self.held = Some((vec![first], Named::barrier()));
            return Ok(());
        }
        let mut batch = vec![first];
        while batch.len() < self.batch_max {
            match self.consumer.next().now_or_never() {
                Some(Some(delivery)) => {
                    let received = Received::of(delivery?);
                    if received.is_prefix_delete() {
                        self.stashed = Some(received);
                        break;
                    }
                    batch.push(received);
                }
                _ => break,
            }
        }
        let jobs = Named::jobs(batch.iter().filter_map(Received::job_key).collect());
        self.held = Some((batch, jobs));
        Ok(())
    }

    /// Best effort and bounded: the connection may already be gone or hung, and
    /// unacked deliveries are requeued by the broker either way. No basic.cancel first:
    /// with a single active consumer, the cancel makes the next bridge active while this
    /// channel still holds prefetched commands, so that bridge would get the commands
    /// behind them first (found by tests/chaos.rs: a SIGTERM reordered a job's
    /// replaces). Closing the channel returns them and hands over in one step.
    async fn close(self) {
        let (channel, side) = (self.channel, self.side);
        amqp::close_quietly("ingest channels", async {
            channel.close(200, "shutdown".into()).await.ok();
            side.close(200, "shutdown".into()).await.ok();
        })
        .await;
    }
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

#[cfg(test)]
mod tests {
    use super::Named;

    #[test]
    fn batches_naming_a_shared_job_or_a_barrier_conflict() {
        let a = Named::jobs(vec![5, 1, 3, 3]);
        assert_eq!(a.jobs, [1, 3, 5]);
        assert!(!a.conflicts(&Named::jobs(vec![2, 4, 6])));
        assert!(a.conflicts(&Named::jobs(vec![0, 5])));
        assert!(!Named::jobs(Vec::new()).conflicts(&a));
        assert!(a.conflicts(&Named::barrier()));
        assert!(Named::barrier().conflicts(&Named::jobs(Vec::new())));
    }
}

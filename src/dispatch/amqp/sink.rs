//! The AMQP sink's round: for each group of due topics, wait for room in the confirm
//! window (`dispatch.window`), reserve what it has room for, and publish each job with
//! `mandatory` in confirm mode, each reserved batch on the next lane; the lane's
//! confirmer settles it. A channel that fails ends the session (reopened by `app.rs`):
//! what was reserved and not sent is failed back to the store at once.
//!
//! The lanes are here too, as the round takes them in turn: `dispatch.channels` confirm
//! channels on the session's connection, each with a confirmer of its own
//! (`confirm.rs`: a channel's confirms and returns are matched against that channel's
//! publishes alone), and whether the broker blocks publishers.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::confirm::{Confirmer, InFlight};
use super::publish::{outgoing_properties, publish};
use crate::amqp::{self, AmqpError};
use crate::config::Config;
use crate::dispatch::reserve::{Reserved, RESERVE_GROUP};
use crate::dispatch::settle::Settler;
use crate::dispatch::sink::{Round, RoundError, Sink};
use crate::dispatch::Core;
use crate::job::Topic;
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::telemetry::{self, Via};

/// The AMQP sink of one dispatch session.
#[derive(Debug)]
pub(crate) struct AmqpSink {
    lanes: Lanes,
    /// Publishes awaiting their confirm, over all lanes: a permit each.
    window: Arc<Semaphore>,
    exchange: String,
    metrics: Arc<Metrics>,
}

impl AmqpSink {
    /// Opens the session's lanes on `connection`; their confirmers settle through
    /// `settler`.
    pub(crate) async fn open(
        connection: &Connection,
        config: &Config,
        settler: &Settler,
        warnings: &Arc<LogThrottle>,
        shutdown: &CancellationToken,
    ) -> Result<Self, AmqpError> {
        let channels = config.dispatch.channels;
        Ok(Self {
            lanes: Lanes::open(connection, channels, settler, warnings, shutdown).await?,
            window: Arc::new(Semaphore::new(config.dispatch.window)),
            exchange: config.amqp.ready_exchange.clone(),
            metrics: settler.metrics.clone(),
        })
    }

    /// Ends the session: confirms in flight get `grace`, then the channels close.
    pub(crate) async fn close(self, grace: Duration) {
        self.lanes.close(grace).await;
    }

    /// Publishes reserved jobs in order, each under a permit of the confirm window
    /// (the first one already taken), each topic's batch on the next lane in turn. If
    /// a channel fails, everything reserved and not sent is failed back to the store
    /// (`Settler::fail_unsent`), so it is due again now instead of after the TTR.
    async fn publish_reserved(
        &self,
        reserved: Vec<(Topic, Vec<Reserved>)>,
        first_permit: OwnedSemaphorePermit,
        settler: &Settler,
    ) -> Result<(), AmqpError> {
        let mut first_permit = Some(first_permit);
        let mut topics = reserved.into_iter();
        while let Some((_, jobs)) = topics.next() {
            let lane = self.lanes.next();
            let mut jobs = jobs.into_iter();
            while let Some(job) = jobs.next() {
                let permit = match first_permit.take() {
                    Some(permit) => permit,
                    // The window is never closed: this only fails if that changes.
                    None => match self.window.clone().acquire_owned().await {
                        Ok(permit) => permit,
                        Err(_) => return Ok(()),
                    },
                };
                if let Err((err, job)) = self.publish(lane, job, permit).await {
                    let reason = format!("channel error: {err}");
                    settler
                        .fail_unsent(std::iter::once(job).chain(jobs), &reason)
                        .await;
                    for (_, jobs) in topics {
                        settler.fail_unsent(jobs, &reason).await;
                    }
                    return Err(err.into());
                }
            }
        }
        Ok(())
    }

    /// Publishes one job on `lane` and hands it to the lane's confirmer; the job comes
    /// back with the error if the channel failed.
    async fn publish(
        &self,
        lane: &Lane,
        mut reserved: Reserved,
        permit: OwnedSemaphorePermit,
    ) -> Result<(), (lapin::Error, Reserved)> {
        let stored = reserved.take_properties();
        let exchange = Via::Amqp {
            exchange: &self.exchange,
        };
        let span =
            telemetry::delivery_span(stored.headers().as_ref(), &reserved.attempt_via(exchange));
        let (job, ticket) = (&reserved.job, &reserved.ticket);
        let topic = &ticket.lease.topic;
        let props = outgoing_properties(topic.as_str(), job, stored, ticket.due_at, &span);
        let published = publish(
            &lane.channel,
            &self.exchange,
            topic,
            job,
            ticket.due_at,
            props,
        );
        let (key, confirm) = match published.await {
            Ok(published) => published,
            Err(err) => {
                telemetry::record_outcome(&span, "error", Some("channel error"));
                return Err((err, reserved));
            }
        };
        let flight = InFlight {
            ticket: reserved.ticket,
            key,
            confirm,
            permit,
            span,
        };
        // The confirmer only stops after this sender is dropped, so it still listens.
        if !flight.hand_to(&lane.in_flight, &self.metrics) {
            tracing::warn!("the confirmer has stopped; a published job waits for its requeue");
        }
        Ok(())
    }
}

impl Sink for AmqpSink {
    fn name(&self) -> &str {
        "dispatch"
    }

    /// Never asked: the AMQP sink takes every topic no other sink serves.
    fn serves(&self, _topic: &Topic) -> bool {
        true
    }

    fn round<'a>(
        &'a self,
        due: Vec<Topic>,
        core: &'a mut Core<'_>,
    ) -> BoxFuture<'a, Result<Round, RoundError>> {
        Box::pin(async move {
            if self.lanes.blocked() {
                // Publishes would only pile up unconfirmed: plan again once it ends.
                self.lanes.wait_unblocked(core.shutdown()).await;
                return Ok(Round::Served);
            }
            if due.is_empty() {
                return Ok(Round::Idle(HashSet::new()));
            }
            for group in due.chunks(RESERVE_GROUP) {
                // Wait for room in the confirm window before taking more jobs.
                let first_permit = tokio::select! {
                    _ = core.shutdown().cancelled() => return Ok(Round::Served),
                    permit = self.window.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => return Ok(Round::Served),
                    },
                };
                let room = self.window.available_permits() + 1;
                let each = (room / group.len()).clamp(1, core.batch());
                let reserved = core.reserve(group, each).await?;
                self.publish_reserved(reserved, first_permit, core.settler())
                    .await?;
            }
            Ok(Round::Served)
        })
    }
}

/// One confirm channel and the sender to its own confirmer.
#[derive(Debug)]
struct Lane {
    channel: Channel,
    in_flight: mpsc::UnboundedSender<InFlight>,
}

/// The lanes of one session, their confirmers and the broker's block.
#[derive(Debug)]
struct Lanes {
    lanes: Vec<Lane>,
    /// Aborted if the session is dropped (`amqp::while_connected` drops one whose
    /// connection died under it): their jobs stay reserved and are requeued.
    confirmers: Vec<AbortOnDropHandle<()>>,
    /// Which lane publishes the next reserved batch.
    turn: AtomicUsize,
    blocked: watch::Receiver<bool>,
}

impl Lanes {
    /// Opens `count` confirm channels on `connection`, each with its confirmer.
    async fn open(
        connection: &Connection,
        count: usize,
        settler: &Settler,
        warnings: &Arc<LogThrottle>,
        shutdown: &CancellationToken,
    ) -> Result<Self, AmqpError> {
        let blocked = watch_blocked(connection, shutdown.clone());
        let mut lanes = Vec::with_capacity(count);
        let mut confirmers = Vec::with_capacity(count);
        for _ in 0..count {
            let channel = amqp::confirm_channel(connection).await?;
            let (in_flight, confirmed) = mpsc::unbounded_channel();
            let confirmer = Confirmer {
                settler: settler.clone(),
                warnings: warnings.clone(),
            };
            confirmers.push(AbortOnDropHandle::new(tokio::spawn(
                confirmer.run(confirmed),
            )));
            lanes.push(Lane { channel, in_flight });
        }
        Ok(Self {
            lanes,
            confirmers,
            turn: AtomicUsize::new(0),
            blocked,
        })
    }

    /// The lane of the next reserved batch: each in turn, so that a busy topic's
    /// batches spread over every channel while each batch stays in order on one.
    fn next(&self) -> &Lane {
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        &self.lanes[turn % self.lanes.len()]
    }

    fn blocked(&self) -> bool {
        *self.blocked.borrow()
    }

    /// Waits while the broker blocks publishers (a resource alarm), or until shutdown.
    async fn wait_unblocked(&self, shutdown: &CancellationToken) {
        tracing::warn!("broker blocked publishers (resource alarm); dispatch paused");
        let mut blocked = self.blocked.clone();
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = blocked.wait_for(|b| !*b) => {
                tracing::info!("broker unblocked; dispatch resumes");
            }
        }
    }

    /// Ends the session's publishing: each confirmer settles what it has (until `grace`
    /// has passed; the rest stays reserved), then the channels close.
    async fn close(self, grace: Duration) {
        let Self {
            lanes,
            mut confirmers,
            ..
        } = self;
        // A confirmer ends once its sender is gone and its publishes are settled.
        let channels: Vec<Channel> = lanes.into_iter().map(|lane| lane.channel).collect();
        let deadline = tokio::time::Instant::now() + grace;
        let mut pending = false;
        for confirmer in &mut confirmers {
            if tokio::time::timeout_at(deadline, &mut *confirmer)
                .await
                .is_err()
            {
                confirmer.abort();
                pending = true;
            }
        }
        if pending {
            tracing::warn!(
                ?grace,
                "confirms still pending at the end of the grace period; those jobs stay reserved and are requeued after their time-to-run"
            );
        }
        let closing = channels.iter().map(|channel| {
            amqp::close_quietly("dispatch channel", channel.close(200, "shutdown".into()))
        });
        futures_util::future::join_all(closing).await;
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

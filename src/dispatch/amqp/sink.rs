//! The AMQP sink's round: for each group of due topics, wait for room in the confirm
//! window (`dispatch.window`), reserve what it has room for, and publish each job with
//! `mandatory` in confirm mode, each reserved batch on the next lane; the lane's
//! confirmer settles it. A channel that fails ends the session (reopened by `app.rs`):
//! what was reserved and not sent is failed back to the store at once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use lapin::Connection;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::channel::{Lane, Lanes};
use super::confirm::InFlight;
use super::publish::{outgoing_properties, publish};
use crate::amqp::AmqpError;
use crate::config::Config;
use crate::dispatch::reserve::{Core, RESERVE_GROUP};
use crate::dispatch::settle::Settler;
use crate::dispatch::sink::{Round, RoundError, Sink};
use crate::dispatch::ticket::Reserved;
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

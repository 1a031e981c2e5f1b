//! The AMQP sink's loop, one per AMQP session: wait out a broker block, bring the plan
//! up to date, nap until something is due, reserve the due topics a group at a time and
//! publish each job with `mandatory` in confirm mode within `dispatch.window`, each
//! reserved batch on the next of `dispatch.channels` lanes; each lane's confirms go to
//! its own `confirm.rs` confirmer, which settles its jobs.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::confirm::{Confirmer, InFlight};
use super::properties::outgoing_properties;
use super::settle::{Settler, Ticket};
use super::sink::{self, Serves};
use super::{expiry, sleep_or_shutdown, Dispatcher, Plan, RESERVE_GROUP};
use crate::amqp::{self, AmqpError};
use crate::job::meta::decode_meta;
use crate::job::Topic;
use crate::store::ReservedJob;

/// One confirm channel of a dispatch session and the sender to its own confirmer: a
/// channel's confirms and returns are matched against that channel's publishes alone.
struct Lane {
    channel: Channel,
    in_flight: mpsc::UnboundedSender<InFlight>,
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
        let blocked = watch_blocked(connection, shutdown.clone());
        let window = Arc::new(Semaphore::new(self.config.dispatch.window));
        let settler = self.settler();
        let mut lanes = Vec::with_capacity(self.config.dispatch.channels);
        // Aborted if this session is dropped (`amqp::while_connected` drops one whose
        // connection died under it): their jobs stay reserved and are requeued.
        let mut confirmers = Vec::with_capacity(self.config.dispatch.channels);
        for _ in 0..self.config.dispatch.channels {
            let channel = amqp::confirm_channel(connection).await?;
            let (in_flight, confirmed) = mpsc::unbounded_channel();
            let confirmer = Confirmer {
                settler: settler.clone(),
                warnings: self.warnings.clone(),
            };
            confirmers.push(AbortOnDropHandle::new(tokio::spawn(
                confirmer.run(confirmed),
            )));
            lanes.push(Lane { channel, in_flight });
        }
        // The webhook loop sets its expired jobs aside on the first channel.
        self.expiry
            .set_session(lanes.first().map(|lane| expiry::Session {
                channel: lane.channel.clone(),
                confirms: lane.in_flight.clone(),
            }));
        let expiry_session = ClearOnDrop(&self.expiry);

        let result = self
            .dispatch_loop(plan, &lanes, blocked, &window, &settler, &shutdown)
            .await;
        // A confirmer ends once every sender is gone, the webhook loop's too.
        drop(expiry_session);
        let channels: Vec<Channel> = lanes.into_iter().map(|lane| lane.channel).collect();
        let grace = Duration::from_millis(self.config.dispatch.shutdown_grace_ms);
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
        for channel in channels {
            amqp::close_quietly("dispatch channel", channel.close(200, "shutdown".into())).await;
        }
        result
    }

    /// The dispatch loop, one named step per line: wait out a broker block, bring the
    /// plan up to date, nap until something is due, then reserve and publish the due
    /// topics a group at a time within the confirm window.
    async fn dispatch_loop(
        &self,
        plan: &mut Plan,
        lanes: &[Lane],
        mut blocked: watch::Receiver<bool>,
        window: &Arc<Semaphore>,
        settler: &Settler,
        shutdown: &CancellationToken,
    ) -> Result<(), AmqpError> {
        let cfg = &self.config.dispatch;
        let poll = Duration::from_millis(cfg.poll_interval_ms);
        let ttr = Duration::from_millis(cfg.ttr_ms);
        let mut redis_backoff = Duration::from_millis(100);
        let mut turns = LaneTurns::default();
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
                if !self.nap(plan, poll, &HashSet::new(), shutdown).await {
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
                    .publish_reserved(lanes, &mut turns, reserved, first_permit, window, settler)
                    .await?
                {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Publishes reserved jobs in order, each under a permit of the confirm window
    /// (the first one already taken), each topic's batch on the next lane in turn.
    /// `Ok(false)` when the window closed (the session is ending). If a channel fails,
    /// everything reserved and not sent is failed back to the store
    /// (`Settler::fail_unsent`), so it is due again now instead of after the TTR.
    async fn publish_reserved(
        &self,
        lanes: &[Lane],
        turns: &mut LaneTurns,
        reserved: Vec<(Topic, Vec<ReservedJob>)>,
        first_permit: tokio::sync::OwnedSemaphorePermit,
        window: &Arc<Semaphore>,
        settler: &Settler,
    ) -> Result<bool, AmqpError> {
        let mut first_permit = Some(first_permit);
        let mut topics = reserved.into_iter();
        while let Some((topic, jobs)) = topics.next() {
            let Lane { channel, in_flight } = turns.next(lanes);
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
        let (key, confirm) =
            expiry::publish(channel, exchange, topic, job, ticket.due_at, props).await?;
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
}

/// Which lane publishes the next reserved batch: each in turn, so that a busy topic's
/// batches spread over every channel while each batch stays in order on one.
#[derive(Default)]
struct LaneTurns(usize);

impl LaneTurns {
    fn next<'a>(&mut self, lanes: &'a [Lane]) -> &'a Lane {
        let lane = &lanes[self.0 % lanes.len()];
        self.0 = self.0.wrapping_add(1);
        lane
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

/// Takes this session's channel away from the expiry sink when the session ends, even
/// when it is dropped.
struct ClearOnDrop<'a>(&'a expiry::Expiry);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set_session(None);
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

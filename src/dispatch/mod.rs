//! Stage 2: jobs out. Reserves due jobs, publishes them to the ready exchange with
//! `mandatory` and publisher confirms, and releases each job only once the broker
//! acked it without returning it. A nack or a return puts the job back with backoff.
//!
//! The loop sleeps until the earliest due time it knows of, or until [`Wake`] says a
//! topic got earlier work. Due-ness itself is decided by the reserve script on the
//! Redis server's clock, so waking early is harmless and a job is never sent early.

mod clock;
mod confirm;
mod wake;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::BasicPublishOptions;
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, decode_meta, outgoing_properties, AmqpError};
use crate::config::Config;
use crate::feed::Feed;
use crate::job::{ReservedJob, Topic};
use crate::metrics::Metrics;
use crate::store::{Lease, Store};
pub use clock::ServerClock;
use confirm::{InFlight, Confirmer};
pub use wake::{listen, parse_notification, Wake};

/// What the dispatcher knows between AMQP sessions: when each topic is next due.
#[derive(Default)]
pub struct Plan {
    next_due: HashMap<Topic, i64>,
    last_rescan: Option<Instant>,
    /// Rotates the starting topic so a hot topic cannot starve the others.
    turn: usize,
}

pub struct Dispatcher {
    pub store: Store,
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub feed: Feed,
    pub wake: Arc<Wake>,
    pub clock: Arc<ServerClock>,
}

impl Dispatcher {
    /// Dispatches over one AMQP connection until `shutdown` (then drains in-flight
    /// confirms within the grace period) or a broker error.
    pub async fn run(&self, plan: &mut Plan, connection: &Connection, shutdown: CancellationToken) -> Result<(), AmqpError> {
        let channel = amqp::confirm_channel(connection).await?;
        let blocked = watch_blocked(connection, shutdown.clone());
        let window = Arc::new(Semaphore::new(self.config.dispatch.window));
        let (in_flight, confirmed) = mpsc::unbounded_channel();
        let confirmer = Confirmer {
            store: self.store.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            feed: self.feed.clone(),
            clock: self.clock.clone(),
        };
        let mut confirmer = tokio::spawn(confirmer.run(confirmed));

        let result = self.dispatch_loop(plan, &channel, blocked, &window, &in_flight, &shutdown).await;
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

    async fn dispatch_loop(
        &self,
        plan: &mut Plan,
        channel: &Channel,
        mut blocked: watch::Receiver<bool>,
        window: &Arc<Semaphore>,
        in_flight: &mpsc::UnboundedSender<InFlight>,
        shutdown: &CancellationToken,
    ) -> Result<(), AmqpError> {
        let cfg = &self.config.dispatch;
        let poll = Duration::from_millis(cfg.poll_interval_ms);
        let ttr = Duration::from_millis(cfg.ttr_ms);
        let mut redis_backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            if *blocked.borrow() {
                tracing::warn!("broker blocked publishers (resource alarm); dispatch paused");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = blocked.wait_for(|b| !*b) => tracing::info!("broker unblocked; dispatch resumes"),
                }
                continue;
            }
            for (topic, due) in self.wake.take_hints() {
                plan.next_due.entry(topic).and_modify(|d| *d = (*d).min(due)).or_insert(due);
            }
            let rescan_due = plan.last_rescan.is_none_or(|at| at.elapsed() >= poll);
            if self.wake.take_rescan() || rescan_due {
                if let Err(err) = self.rescan(plan).await {
                    self.metrics.redis_up.set(0);
                    tracing::warn!(error = %err, retry_in = ?redis_backoff, "redis unavailable; dispatch waits");
                    sleep_or_shutdown(redis_backoff, shutdown).await;
                    redis_backoff = (redis_backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }

            let now = self.clock.now();
            let mut due: Vec<Topic> = plan.next_due.iter().filter(|(_, d)| **d <= now).map(|(t, _)| t.clone()).collect();
            if due.is_empty() {
                let earliest = plan.next_due.values().min().copied();
                let nap = earliest
                    .map(|d| Duration::from_millis(u64::try_from(d - now).unwrap_or(0)))
                    .unwrap_or(poll)
                    .min(poll);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(nap) => {}
                }
                continue;
            }
            due.sort();
            plan.turn = plan.turn.wrapping_add(1);
            let start = plan.turn % due.len();
            due.rotate_left(start);

            for topic in due {
                // Wait for room in the confirm window before taking more jobs.
                let first_permit = tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    permit = window.clone().acquire_owned() => match permit {
                        Ok(p) => p,
                        Err(_) => return Ok(()),
                    },
                };
                let room = (window.available_permits() + 1).min(cfg.batch);
                let batch = match self.store.reserve(&topic, ttr, room).await {
                    Ok(batch) => batch,
                    Err(err) => {
                        self.metrics.redis_up.set(0);
                        tracing::warn!(error = %err, %topic, "reserve failed");
                        sleep_or_shutdown(redis_backoff, shutdown).await;
                        redis_backoff = (redis_backoff * 2).min(Duration::from_secs(5));
                        break;
                    }
                };
                redis_backoff = Duration::from_millis(100);
                self.metrics.redis_up.set(1);
                self.clock.observe(batch.now);
                match batch.next_due {
                    Some(next) => plan.next_due.insert(topic.clone(), next),
                    None => plan.next_due.remove(&topic),
                };
                if !batch.corrupt.is_empty() {
                    self.metrics.corrupt_records.inc_by(batch.corrupt.len() as u64);
                    tracing::error!(%topic, ids = ?batch.corrupt, "scheduled ids with missing or unreadable records taken off the schedule; run `redisched check`");
                }
                let mut first_permit = Some(first_permit);
                let mut jobs = batch.jobs.into_iter();
                while let Some(job) = jobs.next() {
                    let permit = match first_permit.take() {
                        Some(p) => p,
                        None => match window.clone().acquire_owned().await {
                            Ok(p) => p,
                            Err(_) => return Ok(()),
                        },
                    };
                    if let Err(err) = self.publish(channel, &topic, job.clone(), permit, in_flight).await {
                        // The channel is gone: hand back this job and the rest of the
                        // batch so they are due again now instead of after the TTR.
                        let unsent: Vec<ReservedJob> = std::iter::once(job).chain(jobs).collect();
                        self.hand_back(&topic, unsent).await;
                        return Err(err);
                    }
                }
            }
        }
        Ok(())
    }

    async fn publish(
        &self,
        channel: &Channel,
        topic: &Topic,
        job: ReservedJob,
        permit: tokio::sync::OwnedSemaphorePermit,
        in_flight: &mpsc::UnboundedSender<InFlight>,
    ) -> Result<(), AmqpError> {
        let stored = decode_meta(&job.meta).unwrap_or_else(|err| {
            tracing::warn!(%topic, id = %job.id, %err, "job metadata unreadable; delivering without it");
            Default::default()
        });
        let props = outgoing_properties(topic.as_str(), &job, stored);
        let confirm = channel
            .basic_publish(
                self.config.amqp.ready_exchange.as_str().into(),
                topic.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &job.body,
                props,
            )
            .await?;
        self.metrics.publishes_in_flight.inc();
        let flight = InFlight {
            lease: Lease {
                topic: topic.clone(),
                id: job.id,
                token: job.token,
            },
            due_at: job.due_at,
            attempt: job.attempt,
            confirm,
            permit,
        };
        // The confirmer only stops after this sender is dropped.
        let _ = in_flight.send(flight);
        Ok(())
    }

    async fn hand_back(&self, topic: &Topic, jobs: Vec<ReservedJob>) {
        for job in jobs {
            let lease = Lease {
                topic: topic.clone(),
                id: job.id,
                token: job.token,
            };
            if let Err(err) = self.store.retry(&lease, Duration::ZERO).await {
                tracing::warn!(%topic, id = %lease.id, error = %err, "could not hand back a reserved job; it is requeued after its time-to-run");
            }
        }
    }

    /// Re-reads every known topic's earliest due time (one round trip).
    async fn rescan(&self, plan: &mut Plan) -> Result<(), crate::store::StoreError> {
        let topics = self.store.topics().await?;
        let heads = self.store.next_due_times(&topics).await?;
        let now = self.store.server_time().await?;
        self.clock.observe(now);
        plan.next_due.clear();
        for (topic, head) in topics.into_iter().zip(heads) {
            if let Some(due) = head {
                plan.next_due.insert(topic, due);
            }
        }
        plan.last_rescan = Some(Instant::now());
        self.metrics.redis_up.set(1);
        Ok(())
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
                    let _ = tx.send(true);
                }
                Some(lapin::Event::ConnectionUnblocked) => {
                    let _ = tx.send(false);
                }
                Some(_) => {}
                None => return,
            }
        }
    });
    rx
}

/// Delay before retrying a job the broker refused: doubles per attempt, capped.
pub fn retry_delay(config: &Config, attempt: u32) -> Duration {
    let min = config.dispatch.retry_min_ms;
    let factor = 1u64 << attempt.saturating_sub(1).min(20);
    Duration::from_millis(min.saturating_mul(factor).min(config.dispatch.retry_max_ms))
}

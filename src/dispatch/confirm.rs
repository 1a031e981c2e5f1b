//! The other half of the confirm window: awaits each publish's broker confirm in
//! publish order, releases acked jobs in batches (one round trip per batch), and puts
//! refused ones back with backoff.

use std::sync::Arc;
use std::time::Duration;

use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::{retry_delay, ServerClock};
use crate::config::Config;
use crate::feed::{Event, Feed};
use crate::metrics::Metrics;
use crate::store::{Lease, Store};

/// Releases are batched up to this many per round trip.
const RELEASE_BATCH: usize = 500;

pub(crate) struct InFlight {
    pub lease: Lease,
    pub due_at: i64,
    pub attempt: u32,
    pub confirm: PublisherConfirm,
    /// Returned to the window when the job is released or handed back.
    pub permit: OwnedSemaphorePermit,
}

struct Acked {
    lease: Lease,
    due_at: i64,
    attempt: u32,
    _permit: OwnedSemaphorePermit,
}

pub(crate) struct Confirmer {
    pub store: Store,
    pub config: Arc<Config>,
    pub metrics: Arc<Metrics>,
    pub feed: Feed,
    pub clock: Arc<ServerClock>,
}

impl Confirmer {
    /// Runs until the sender is dropped and every publish sent so far is settled.
    pub async fn run(self, mut in_flight: mpsc::UnboundedReceiver<InFlight>) {
        let mut acked: Vec<Acked> = Vec::new();
        loop {
            let next = if acked.is_empty() {
                in_flight.recv().await
            } else {
                match in_flight.try_recv() {
                    Ok(flight) => Some(flight),
                    Err(TryRecvError::Empty) => {
                        self.release(&mut acked).await;
                        continue;
                    }
                    Err(TryRecvError::Disconnected) => None,
                }
            };
            let Some(flight) = next else { break };
            let InFlight {
                lease,
                due_at,
                attempt,
                confirm,
                permit,
            } = flight;
            let confirmation = confirm.await;
            self.metrics.publishes_in_flight.dec();
            match confirmation {
                Ok(Confirmation::Ack(None)) => {
                    acked.push(Acked {
                        lease,
                        due_at,
                        attempt,
                        _permit: permit,
                    });
                    if acked.len() >= RELEASE_BATCH {
                        self.release(&mut acked).await;
                    }
                }
                Ok(Confirmation::Ack(Some(returned))) => {
                    self.metrics.unroutable_returns.inc();
                    tracing::warn!(topic = %lease.topic, id = %lease.id, reply = %returned.reply_text, "job unroutable (no queue bound for its topic); kept and retried");
                    self.hand_back(&lease, retry_delay(&self.config, attempt), "unroutable")
                        .await;
                }
                Ok(Confirmation::Nack(_)) => {
                    tracing::warn!(topic = %lease.topic, id = %lease.id, "broker nacked a job; kept and retried");
                    self.hand_back(&lease, retry_delay(&self.config, attempt), "nack")
                        .await;
                }
                Ok(Confirmation::NotRequested) | Err(_) => {
                    // The channel died before the broker answered: the job may or may
                    // not be queued. Making it due again now risks a duplicate, never
                    // a loss.
                    self.hand_back(&lease, Duration::ZERO, "error").await;
                }
            }
        }
        self.release(&mut acked).await;
    }

    /// Deletes the acked jobs from Redis. While Redis is unreachable this keeps trying
    /// and keeps the window permits, so dispatch pauses rather than piling up work.
    async fn release(&self, acked: &mut Vec<Acked>) {
        if acked.is_empty() {
            return;
        }
        let leases: Vec<Lease> = acked.iter().map(|a| a.lease.clone()).collect();
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.store.release(&leases).await {
                Ok(released) => {
                    if (released as usize) < leases.len() {
                        tracing::debug!(
                            stale = leases.len() - released as usize,
                            "some confirmed jobs were replaced, deleted or requeued meanwhile"
                        );
                    }
                    break;
                }
                Err(err) => {
                    self.metrics.redis_up.set(0);
                    tracing::warn!(error = %err, retry_in = ?backoff, "cannot release confirmed jobs yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        let now = self.clock.now();
        for done in acked.drain(..) {
            let lateness_ms = (now - done.due_at).max(0);
            self.metrics.jobs_dispatched.inc();
            self.metrics.lateness.observe(lateness_ms as f64 / 1000.0);
            self.feed.send(Event::Dispatched {
                topic: done.lease.topic.to_string(),
                id: done.lease.id,
                due_at: done.due_at,
                attempt: done.attempt,
                at: now,
                lateness_ms,
            });
        }
    }

    async fn hand_back(&self, lease: &Lease, delay: Duration, reason: &str) {
        self.metrics.retry(reason);
        match self.store.retry(lease, delay).await {
            Ok(_) => {}
            Err(err) => tracing::warn!(topic = %lease.topic, id = %lease.id, error = %err,
                "could not put a refused job back; it is requeued after its time-to-run"),
        }
    }
}

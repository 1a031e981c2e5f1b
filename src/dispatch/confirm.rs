//! The AMQP sink's other half: awaits each publish's broker confirm in publish order,
//! and reports the outcomes to the settle module: acked jobs are released in batches
//! (one round trip per batch), refused ones handed back with backoff.

use std::sync::Arc;
use std::time::Duration;

use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::settle::{Settler, Ticket};
use crate::log_throttle::LogThrottle;

/// Releases are batched up to this many per round trip.
const RELEASE_BATCH: usize = 500;

pub(crate) struct InFlight {
    pub ticket: Ticket,
    pub confirm: PublisherConfirm,
    /// Returned to the window when the job is released or handed back.
    pub permit: OwnedSemaphorePermit,
}

pub(crate) struct Confirmer {
    pub settler: Settler,
    pub warnings: Arc<LogThrottle>,
}

impl Confirmer {
    /// Runs until the sender is dropped and every publish sent so far is settled.
    pub(super) async fn run(self, mut in_flight: mpsc::UnboundedReceiver<InFlight>) {
        let mut acked: Vec<(Ticket, OwnedSemaphorePermit)> = Vec::new();
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
            let Some(InFlight {
                ticket,
                confirm,
                permit,
            }) = next
            else {
                break;
            };
            let confirmation = confirm.await;
            let metrics = &self.settler.metrics;
            metrics.publishes_in_flight.dec();
            let lease = &ticket.lease;
            let backoff = self.settler.retry_delay(ticket.attempt);
            match confirmation {
                Ok(Confirmation::Ack(None)) => {
                    acked.push((ticket, permit));
                    if acked.len() >= RELEASE_BATCH {
                        self.release(&mut acked).await;
                    }
                }
                Ok(Confirmation::Ack(Some(returned))) => {
                    metrics.unroutable_returns.inc();
                    if self.warnings.admit(
                        lease.topic.as_str(),
                        "unroutable jobs retried",
                        returned.reply_text.as_str(),
                    ) {
                        tracing::warn!(topic = %lease.topic, id = %lease.id, reply = %returned.reply_text, "job unroutable (no queue bound for its topic); kept and retried");
                    }
                    let reason = match ticket.expired {
                        // The expired exchange has no queue bound for the topic.
                        Some(_) => format!("expired, and unroutable: {}", returned.reply_text),
                        None => format!("unroutable: {}", returned.reply_text),
                    };
                    self.settler
                        .fail(lease, backoff, "unroutable", &reason)
                        .await;
                }
                Ok(Confirmation::Nack(_)) => {
                    if self
                        .warnings
                        .admit(lease.topic.as_str(), "nacked jobs retried", "nack")
                    {
                        tracing::warn!(topic = %lease.topic, id = %lease.id, "broker nacked a job; kept and retried");
                    }
                    self.settler.fail(lease, backoff, "nack", "nack").await;
                }
                Ok(Confirmation::NotRequested) | Err(_) => {
                    // The channel died before the broker answered: the job may or may
                    // not be queued. Making it due again now risks a duplicate, never
                    // a loss.
                    let reason = match &confirmation {
                        Err(err) => format!("channel error: {err}"),
                        _ => "channel error: no publisher confirm".to_owned(),
                    };
                    self.settler
                        .fail(lease, Duration::ZERO, "error", &reason)
                        .await;
                }
            }
        }
        self.release(&mut acked).await;
    }

    /// Releases the acked jobs; their window permits return only afterwards.
    async fn release(&self, acked: &mut Vec<(Ticket, OwnedSemaphorePermit)>) {
        // Moved out, not cloned (a ticket holds the job's topic, id and note); the
        // permits are held until the release returned.
        let (tickets, permits): (Vec<Ticket>, Vec<OwnedSemaphorePermit>) = acked.drain(..).unzip();
        self.settler.release(&tickets).await;
        drop(permits);
    }
}

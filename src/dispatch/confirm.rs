//! The other half of the confirm window: awaits each publish's broker confirm in
//! publish order, releases acked jobs in batches (one round trip per batch), and puts
//! refused ones back with backoff.

use std::sync::Arc;
use std::time::Duration;

use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::{record_failure, retry_delay, ServerClock};
use crate::config::Config;
use crate::feed::{Event, Feed};
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::schedule::Schedule;
use crate::store::{Delivered, DueHints, Lease, NextDue, Store};

/// Releases are batched up to this many per round trip.
const RELEASE_BATCH: usize = 500;

pub(crate) struct InFlight {
    pub lease: Lease,
    /// A series occurrence: released with its next occurrence.
    pub schedule: Option<Schedule>,
    pub due_at: i64,
    pub attempt: u32,
    pub confirm: PublisherConfirm,
    /// Returned to the window when the job is released or handed back.
    pub permit: OwnedSemaphorePermit,
}

struct Acked {
    lease: Lease,
    schedule: Option<Schedule>,
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
    pub warnings: Arc<LogThrottle>,
    /// The dispatcher's board: a series moved to its next occurrence is hinted there.
    pub hints: Arc<DueHints>,
}

impl Confirmer {
    /// Runs until the sender is dropped and every publish sent so far is settled.
    pub(super) async fn run(self, mut in_flight: mpsc::UnboundedReceiver<InFlight>) {
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
                schedule,
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
                        schedule,
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
                    if self.warnings.admit(
                        lease.topic.as_str(),
                        "unroutable jobs retried",
                        returned.reply_text.as_str(),
                    ) {
                        tracing::warn!(topic = %lease.topic, id = %lease.id, reply = %returned.reply_text, "job unroutable (no queue bound for its topic); kept and retried");
                    }
                    let reason = format!("unroutable: {}", returned.reply_text);
                    self.hand_back(
                        &lease,
                        retry_delay(&self.config, attempt),
                        "unroutable",
                        &reason,
                    )
                    .await;
                }
                Ok(Confirmation::Nack(_)) => {
                    if self
                        .warnings
                        .admit(lease.topic.as_str(), "nacked jobs retried", "nack")
                    {
                        tracing::warn!(topic = %lease.topic, id = %lease.id, "broker nacked a job; kept and retried");
                    }
                    self.hand_back(&lease, retry_delay(&self.config, attempt), "nack", "nack")
                        .await;
                }
                Ok(Confirmation::NotRequested) | Err(_) => {
                    // The channel died before the broker answered: the job may or may
                    // not be queued. Making it due again now risks a duplicate, never
                    // a loss.
                    let reason = match &confirmation {
                        Err(err) => format!("channel error: {err}"),
                        _ => "channel error: no publisher confirm".to_owned(),
                    };
                    self.hand_back(&lease, Duration::ZERO, "error", &reason)
                        .await;
                }
            }
        }
        self.release(&mut acked).await;
    }

    /// Releases the acked jobs in Redis: deletes one-shot jobs, moves each series to
    /// its next occurrence (the first one strictly after both now and the delivered
    /// occurrence: occurrences missed while no bridge ran collapse into the one just
    /// delivered). While Redis is unreachable this keeps trying and keeps the window
    /// permits, so dispatch pauses rather than piling up work.
    async fn release(&self, acked: &mut Vec<Acked>) {
        if acked.is_empty() {
            return;
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            // The server's clock as last read (it can only lag it): a next occurrence a
            // hair in the past is simply due at once, never early. Read again on each
            // try, so a long Redis outage does not schedule occurrences in the past.
            let leases = delivered(acked, self.clock.now());
            match self.store.release_delivered(&leases).await {
                Ok(released) => {
                    if (released as usize) < leases.len() {
                        tracing::debug!(
                            stale = leases.len() - released as usize,
                            "some confirmed jobs were replaced, deleted or requeued meanwhile"
                        );
                    }
                    hint_next_occurrences(&self.hints, &leases);
                    break;
                }
                Err(err) => {
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
            self.feed.send_with(|| Event::Dispatched {
                topic: done.lease.topic.to_string(),
                id: done.lease.id,
                due_at: done.due_at,
                attempt: done.attempt,
                at: now,
                lateness_ms,
            });
        }
    }

    async fn hand_back(&self, lease: &Lease, delay: Duration, kind: &str, reason: &str) {
        record_failure(
            &self.store,
            &self.config,
            &self.metrics,
            lease,
            delay,
            kind,
            reason,
        )
        .await;
    }
}

/// Tells the dispatcher when each released series is due next. The plan learned the
/// topic's next due time from the reserve reply, taken while the series was reserved
/// and so blind to it, and `release.lua` publishes nothing: without this hint the next
/// occurrence would wait for the rescan (`dispatch.poll_interval_ms`). Posted after the
/// release returned, so any reserve the hint leads to runs after the move. A stale
/// lease (nothing moved) costs at most one empty reserve.
fn hint_next_occurrences(hints: &DueHints, delivered: &[Delivered]) {
    for d in delivered {
        if let NextDue::At(next) = d.next_due {
            hints.hint(&d.lease.topic, next);
        }
    }
}

/// What releasing each acked job does at `now`: delete a one-shot job, move a series to
/// its next occurrence, or end a series that has none.
fn delivered(acked: &[Acked], now: i64) -> Vec<Delivered> {
    acked
        .iter()
        .map(|a| Delivered {
            lease: a.lease.clone(),
            next_due: match &a.schedule {
                None => NextDue::OneShot,
                Some(schedule) => match schedule.next_occurrence(a.due_at, now) {
                    Some(next) => NextDue::At(next),
                    None => {
                        tracing::warn!(topic = %a.lease.topic, id = %a.lease.id, %schedule,
                            "series has no further occurrence; it ends");
                        NextDue::End
                    }
                },
            },
        })
        .collect()
}

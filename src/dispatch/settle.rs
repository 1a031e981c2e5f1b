//! Settling a delivery attempt, whatever the sink (the handle step of reserve → send →
//! settle): a delivered job is released (a one-shot deleted, a series moved to its next
//! occurrence, token-fenced), a failed one handed back with backoff and parked at
//! `dispatch.max_attempts`. Sinks only report outcomes here ([`Settler::release`],
//! [`Settler::retry`]); they never touch the store.

use std::sync::Arc;
use std::time::Duration;

use super::clock::ServerClock;
use super::reserve::{Reserved, Ticket};
use crate::config::Config;
use crate::feed::{Event, Feed};
use crate::metrics::Metrics;
use crate::store::{
    Delivered, DueHints, Expired, Lease, NextDue, Noted, RetryOutcome, Store, StoreError,
};

/// Where every sink reports what came of each job it was given.
#[derive(Debug, Clone)]
pub struct Settler {
    pub(crate) store: Store,
    pub(crate) config: Arc<Config>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) feed: Feed,
    pub(crate) clock: Arc<ServerClock>,
    /// The board of the loop this settles for: a series moved to its next occurrence is
    /// hinted there.
    pub(crate) hints: Arc<DueHints>,
}

impl Settler {
    /// Releases delivered jobs in Redis: deletes one-shot jobs, moves each series to
    /// its next occurrence (the first one strictly after both now and the delivered
    /// occurrence: occurrences missed while no bridge ran collapse into the one just
    /// delivered). While Redis is unreachable this keeps trying, and the caller keeps
    /// its in-flight permits, so dispatch pauses rather than piling up work.
    /// Jobs set aside as expired (their copy confirmed by the expired exchange) are
    /// released the same way, logged `expired` and counted apart.
    pub async fn release(&self, done: &[Ticket]) {
        let (expired, done): (Vec<Ticket>, Vec<Ticket>) =
            done.iter().cloned().partition(|t| t.expired.is_some());
        if !expired.is_empty() {
            self.release_expired(&expired).await;
        }
        let done = done.as_slice();
        if done.is_empty() {
            return;
        }
        self.release_until_answered(done, false).await;
        let now = self.clock.now();
        for done in done {
            let lateness_ms = (now - done.due_at).max(0);
            self.metrics.jobs_dispatched.inc();
            self.metrics.lateness.observe(lateness_ms as f64 / 1000.0);
            self.feed.send_with(|| Event::Dispatched {
                topic: done.lease.topic.to_string(),
                id: done.lease.id.clone(),
                due_at: done.due_at,
                attempt: done.attempt,
                at: now,
                lateness_ms,
            });
        }
    }

    /// Releases `done` (logged `expired` when `expired`), retrying until Redis answers,
    /// and hints the plan of every series moved on.
    async fn release_until_answered(&self, done: &[Ticket], expired: bool) {
        let mut backoff = Duration::from_millis(100);
        loop {
            // The server's clock as last read (it can only lag it): a next occurrence a
            // hair in the past is simply due at once, never early. Read again on each
            // try, so a long Redis outage does not schedule occurrences in the past.
            let leases = delivered(done, self.clock.now());
            let answer = if expired {
                let expired: Vec<Expired> = leases.iter().cloned().map(Expired).collect();
                self.store.release_expired(&expired).await
            } else {
                self.store.release_noted(&leases).await
            };
            match answer {
                Ok(released) => {
                    released_all(&self.hints, &leases, released);
                    return;
                }
                Err(err) => backoff = wait_for_redis(err, backoff).await,
            }
        }
    }

    /// Releases expired jobs whose copy the expired exchange confirmed: a one-shot job
    /// is deleted, a series moves to its next occurrence (this one is set aside, the
    /// next still scheduled), each logged `expired`, counted in
    /// `redisched_jobs_expired_total{topic}`.
    async fn release_expired(&self, done: &[Ticket]) {
        self.release_until_answered(done, true).await;
        let now = self.clock.now();
        for done in done {
            let expires_after_ms = done.expired.unwrap_or(0);
            self.metrics.expired(done.lease.topic.as_str());
            tracing::debug!(topic = %done.lease.topic, id = %done.lease.id, due_at = done.due_at, expires_after_ms, "job expired; set aside to the expired exchange");
            self.feed.send_with(|| Event::Expired {
                topic: done.lease.topic.to_string(),
                id: done.lease.id.clone(),
                due_at: done.due_at,
                attempt: done.attempt,
                expires_after_ms,
                at: now,
            });
        }
    }

    /// Puts a reserved job off, due again after `delay`, without recording a failure
    /// (an expired job the set-aside has no channel or no room for just now); if even
    /// that fails, its reservation expires and it is requeued.
    /// (A failed delivery is [`Settler::fail`].)
    pub(crate) async fn defer(&self, lease: &Lease, delay: Duration) {
        match self.store.retry(lease, delay).await {
            Ok(true) => {
                let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
                self.hints
                    .hint(&lease.topic, self.clock.now().saturating_add(delay_ms));
            }
            Ok(false) => {}
            Err(err) => tracing::warn!(topic = %lease.topic, id = %lease.id, error = %err,
                "could not hand back an expired job; it is requeued after its time-to-run"),
        }
    }

    /// A delivery that failed: the job handed back with `reason` (its `last_error`), due
    /// again after the backoff of its attempt; `kind` labels
    /// `redisched_publish_retries_total` (the sink's name for what went wrong).
    pub async fn retry(&self, ticket: &Ticket, kind: &str, reason: &str) {
        let backoff = self.retry_delay(ticket.attempt);
        self.fail(&ticket.lease, backoff, kind, reason).await;
    }

    /// Hands a job whose delivery failed back to the store with `reason` (shown as its
    /// `last_error`), due again after `delay`; parks it once its failures reach
    /// `dispatch.max_attempts` (0 = never). `kind` labels the retry metric (`nack`,
    /// `unroutable`, `error`, `webhook`).
    pub(crate) async fn fail(&self, lease: &Lease, delay: Duration, kind: &str, reason: &str) {
        self.metrics.retry(kind);
        let max_attempts = self.config.dispatch.max_attempts;
        match self
            .store
            .retry_failed(lease, delay, reason, max_attempts)
            .await
        {
            Ok(RetryOutcome::Parked) => tracing::warn!(
                topic = %lease.topic, id = %lease.id, %reason, max_attempts,
                "job parked after too many failed deliveries; re-drive it once the cause is fixed"
            ),
            // Due again after `delay`: wake for it then, as for a series' next occurrence,
            // instead of waiting for the rescan (the estimate can only be early by the
            // round trip, which costs one empty reserve).
            Ok(RetryOutcome::Retried) => {
                let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
                self.hints
                    .hint(&lease.topic, self.clock.now().saturating_add(delay_ms));
            }
            Ok(RetryOutcome::Stale) => {}
            Err(err) => tracing::warn!(topic = %lease.topic, id = %lease.id, error = %err,
                "could not hand back a job whose delivery failed; it is requeued after its time-to-run"),
        }
    }

    /// Parks a job whose delivery no retry can mend (a job URL the guard refuses):
    /// its failure recorded with `reason`, kept until re-driven.
    pub(crate) async fn park(&self, lease: &Lease, reason: &str) {
        match self
            .store
            .retry_failed(lease, Duration::ZERO, reason, 1)
            .await
        {
            Ok(RetryOutcome::Parked) => tracing::warn!(
                topic = %lease.topic, id = %lease.id, %reason,
                "job parked: its delivery was refused; re-drive it once the cause is fixed"
            ),
            Ok(_) => {}
            Err(err) => tracing::warn!(topic = %lease.topic, id = %lease.id, error = %err,
                "could not park a job whose delivery was refused; it is requeued after its time-to-run"),
        }
    }

    /// A series occurrence that cannot be delivered because its next occurrence cannot
    /// be computed ([`Ticket::of`]): its failure, with the usual backoff.
    pub(crate) async fn fail_unreadable(&self, lease: &Lease, attempt: u32, reason: &str) {
        tracing::error!(topic = %lease.topic, id = %lease.id, %reason, "series not delivered");
        self.fail(lease, self.retry_delay(attempt), "error", reason)
            .await;
    }

    /// Jobs reserved but not sent because the sink's channel failed: due again now, the
    /// failure recorded on each (it counts towards `max_attempts`).
    pub(crate) async fn fail_unsent(
        &self,
        unsent: impl IntoIterator<Item = Reserved>,
        reason: &str,
    ) {
        for reserved in unsent {
            self.fail(&reserved.ticket.lease, Duration::ZERO, "error", reason)
                .await;
        }
    }

    /// A job a sink took but could not start (no room after all): due again now,
    /// no failure recorded (or, if Redis does not answer, once its TTR expires).
    pub(crate) async fn hand_back(&self, lease: &Lease) {
        if let Err(error) = self.store.retry(lease, Duration::ZERO).await {
            tracing::warn!(%error, topic = %lease.topic, "could not hand a job back; its reservation expires into a requeue");
        }
    }

    /// The backoff before attempt `attempt + 1`.
    pub(crate) fn retry_delay(&self, attempt: u32) -> Duration {
        retry_delay(&self.config, attempt)
    }
}

/// Delay before retrying a job whose delivery failed: doubles per attempt, capped.
pub fn retry_delay(config: &Config, attempt: u32) -> Duration {
    let min = config.dispatch.retry_min_ms;
    let factor = 1u64 << attempt.saturating_sub(1).min(20);
    Duration::from_millis(min.saturating_mul(factor).min(config.dispatch.retry_max_ms))
}

/// After a release call: logs stale leases and hints the next occurrences.
fn released_all(hints: &DueHints, leases: &[Noted], released: u64) {
    if (released as usize) < leases.len() {
        tracing::debug!(
            stale = leases.len() - released as usize,
            "some delivered jobs were replaced, deleted or requeued meanwhile"
        );
    }
    hint_next_occurrences(hints, leases);
}

/// Waits out a failed release call; returns the next backoff.
async fn wait_for_redis(err: StoreError, backoff: Duration) -> Duration {
    tracing::warn!(error = %err, retry_in = ?backoff, "cannot release delivered jobs yet");
    tokio::time::sleep(backoff).await;
    (backoff * 2).min(Duration::from_secs(5))
}

/// Tells the dispatcher when each released series is due next. The plan learned the
/// topic's next due time from the reserve reply, taken while the series was reserved
/// and so blind to it, and `release.lua` publishes nothing: without this hint the next
/// occurrence would wait for the rescan (`dispatch.poll_interval_ms`). Posted after the
/// release returned, so any reserve the hint leads to runs after the move. A stale
/// lease (nothing moved) costs at most one empty reserve.
fn hint_next_occurrences(hints: &DueHints, released: &[Noted]) {
    for noted in released {
        let due = match noted.delivered.next_due {
            NextDue::At(next) => next,
            NextDue::Jittered { at, delay_ms } => {
                at.saturating_add(i64::try_from(delay_ms).unwrap_or(0))
            }
            NextDue::OneShot | NextDue::End => continue,
        };
        hints.hint(&noted.delivered.lease.topic, due);
    }
}

/// What releasing each delivered job does at `now`: delete a one-shot job, move a
/// series to its next occurrence (on its grid, counted from the scheduled time; a
/// jittered one with the next occurrence's delay), or end a series that has none.
fn delivered(done: &[Ticket], now: i64) -> Vec<Noted> {
    done.iter()
        .map(|a| Noted {
            note: a.note.clone(),
            delivered: Delivered {
                lease: a.lease.clone(),
                next_due: match &a.schedule {
                    None => NextDue::OneShot,
                    Some(schedule) if a.jitter_ms > 0 => match schedule.next_jittered(
                        a.lease.topic.as_str(),
                        &a.lease.id,
                        a.scheduled_at,
                        now,
                        a.jitter_ms,
                    ) {
                        Some((at, delay_ms)) => NextDue::Jittered { at, delay_ms },
                        None => {
                            tracing::warn!(topic = %a.lease.topic, id = %a.lease.id, %schedule,
                            "series has no further occurrence; it ends");
                            NextDue::End
                        }
                    },
                    Some(schedule) => match schedule.next_occurrence(a.scheduled_at, now) {
                        Some(next) => NextDue::At(next),
                        None => {
                            tracing::warn!(topic = %a.lease.topic, id = %a.lease.id, %schedule,
                            "series has no further occurrence; it ends");
                            NextDue::End
                        }
                    },
                },
            },
        })
        .collect()
}

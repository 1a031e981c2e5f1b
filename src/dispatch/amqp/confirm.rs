//! The confirmer: awaits each publish's broker confirm in publish order, and reports the
//! outcomes to the settle module: acked jobs are released in batches (one round trip
//! per batch), refused ones handed back with backoff. One per confirm channel: each of
//! the AMQP sink's lanes and the set-aside's channel.
//!
//! A `basic.return` (the broker found no queue for a `mandatory` publish) carries no
//! delivery tag: AMQP only promises it arrives before that publish's ack. lapin hands
//! each return to whichever confirm it resolves next, and resolves the tags of a
//! multiple-ack in no particular order, so a return may ride on another job's confirm,
//! earlier or later in the window. Trusting that pairing released unroutable jobs as
//! delivered (lost) and retried delivered ones. So a return is matched to its job by
//! the message itself ([`ReturnKey`]), and an acked job is released only once it has
//! *settled*: [`SETTLE`] after its ack was seen, by when every return that arrived
//! before that ack has reached some confirm this loop has seen. Releases are batched:
//! once caught up with the confirms, when every acked job has settled, or when the
//! oldest has waited [`MAX_HOLD`]; at [`RELEASE_BATCH`] acked jobs at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use lapin::message::BasicReturnMessage;
use lapin::{Confirmation, PublisherConfirm};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio::time::Instant;
use tracing::Span;

use super::publish::ReturnKey;
use crate::dispatch::reserve::Ticket;
use crate::dispatch::settle::Settler;
use crate::log_throttle::LogThrottle;
use crate::metrics::Metrics;
use crate::telemetry;

/// Releases are batched up to this many per round trip.
const RELEASE_BATCH: usize = 500;
/// How long an acked job waits before its release, so that a return lapin paired with
/// a confirm resolved a moment later (the rest of the same multiple-ack, a publish not
/// yet handed over) is seen first.
const SETTLE: Duration = Duration::from_millis(5);
/// Acked jobs wait for more to join their release (one round trip for many) while
/// confirms keep coming, but none longer than this: its permit is held meanwhile, and
/// a series' next occurrence is scheduled only by the release.
const MAX_HOLD: Duration = Duration::from_millis(25);
/// A return whose job is not among those in flight after this long matched none: its
/// job was released before the return was seen (logged as an error).
const ORPHAN_AFTER: Duration = Duration::from_secs(60);

pub(crate) struct InFlight {
    pub ticket: Ticket,
    pub key: ReturnKey,
    pub confirm: PublisherConfirm,
    /// Returned to its window (the AMQP sink's, or the set-aside's) when the job is
    /// released or handed back.
    pub permit: OwnedSemaphorePermit,
    /// The attempt's delivery span (`Span::none()` unless exported): ends once the job
    /// was released or handed back, with how it went.
    pub span: Span,
}

impl InFlight {
    /// Hands this publish to its session's confirmer; `publishes_in_flight` counts it
    /// until the confirmer has its confirm. `false` if the confirmer has stopped: the job
    /// stays reserved until its time-to-run requeues it.
    pub(crate) fn hand_to(
        self,
        confirmer: &mpsc::UnboundedSender<InFlight>,
        metrics: &Metrics,
    ) -> bool {
        metrics.publishes_in_flight.inc();
        let handed = confirmer.send(self).is_ok();
        if !handed {
            metrics.publishes_in_flight.dec();
        }
        handed
    }
}

/// Acked without a return seen so far; released once settled.
struct Acked {
    ticket: Ticket,
    key: ReturnKey,
    permit: OwnedSemaphorePermit,
    seen: Instant,
    span: Span,
}

/// Settles the publishes of one confirm channel.
pub(crate) struct Confirmer {
    pub settler: Settler,
    pub warnings: Arc<LogThrottle>,
}

/// The confirmer's jobs between confirm and settle.
#[derive(Default)]
struct Settling {
    acked: Vec<Acked>,
    /// Returns whose job's confirm has not been seen yet.
    ahead: HashMap<ReturnKey, Ahead>,
}

/// A return seen before its job's confirm.
struct Ahead {
    reply: String,
    /// The returned message's routing key and message id, for the log if it stays
    /// unmatched.
    topic: String,
    id: String,
    seen: Instant,
}

impl Confirmer {
    /// Runs until the sender is dropped and every publish sent so far is settled.
    pub(crate) async fn run(self, mut in_flight: mpsc::UnboundedReceiver<InFlight>) {
        let mut settling = Settling::default();
        loop {
            let next = match in_flight.try_recv() {
                Ok(flight) => Some(flight),
                Err(TryRecvError::Disconnected) => None,
                // Caught up: wait for the next confirm, or release what has settled.
                Err(TryRecvError::Empty) => match settling.release_at() {
                    None => in_flight.recv().await,
                    Some(at) => tokio::select! {
                        biased;
                        next = in_flight.recv() => next,
                        () = tokio::time::sleep_until(at) => {
                            self.release_settled(&mut settling, Instant::now()).await;
                            continue;
                        }
                    },
                },
            };
            let Some(flight) = next else {
                break;
            };
            self.settle_one(flight, &mut settling).await;
            let now = Instant::now();
            if settling.acked.len() >= RELEASE_BATCH || settling.held_too_long(now) {
                self.release_settled(&mut settling, now).await;
            }
        }
        // No publish is left to carry a return: what is acked is delivered.
        let far = Instant::now() + SETTLE + ORPHAN_AFTER;
        self.release_settled(&mut settling, far).await;
    }

    /// Awaits one publish's confirm and files its job: acked (to settle), or failed.
    async fn settle_one(&self, flight: InFlight, settling: &mut Settling) {
        let InFlight {
            ticket,
            key,
            confirm,
            permit,
            span,
        } = flight;
        let confirmation = confirm.await;
        self.settler.metrics.publishes_in_flight.dec();
        match confirmation {
            Ok(Confirmation::Ack(returned)) => {
                let own = self.file_return(returned, key, settling).await;
                match own.or_else(|| settling.ahead.remove(&key).map(|ahead| ahead.reply)) {
                    Some(reply) => self.unroutable(&ticket, &reply, &span).await,
                    None => settling.acked.push(Acked {
                        ticket,
                        key,
                        permit,
                        seen: Instant::now(),
                        span,
                    }),
                }
            }
            Ok(Confirmation::Nack(returned)) => {
                // A nack fails the job whatever its return says; another's still counts.
                self.file_return(returned, key, settling).await;
                settling.ahead.remove(&key);
                let lease = &ticket.lease;
                if self
                    .warnings
                    .admit(lease.topic.as_str(), "nacked jobs retried", "nack")
                {
                    tracing::warn!(topic = %lease.topic, id = %lease.id, "broker nacked a job; kept and retried");
                }
                telemetry::record_outcome(&span, "nacked", Some("nack"));
                self.settler.retry(&ticket, "nack", "nack").await;
            }
            Ok(Confirmation::NotRequested) | Err(_) => {
                // The channel died before the broker answered: the job may or may
                // not be queued. Making it due again now risks a duplicate, never
                // a loss.
                let reason = match &confirmation {
                    Err(err) => format!("channel error: {err}"),
                    _ => "channel error: no publisher confirm".to_owned(),
                };
                telemetry::record_outcome(&span, "error", Some(&reason));
                self.settler
                    .fail(&ticket.lease, Duration::ZERO, "error", &reason)
                    .await;
            }
        }
    }

    /// Files a return that came with the confirm of the publish keyed `own`: its reply
    /// text if it is that publish's; else it fails the acked job it belongs to, or is
    /// kept for a confirm still to come.
    async fn file_return(
        &self,
        returned: Option<BasicReturnMessage>,
        own: ReturnKey,
        settling: &mut Settling,
    ) -> Option<String> {
        let returned = returned?;
        self.settler.metrics.unroutable_returns.inc();
        let delivery = &returned.delivery;
        let ahead = Ahead {
            reply: returned.reply_text.to_string(),
            topic: delivery.routing_key.to_string(),
            id: delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string())
                .unwrap_or_default(),
            seen: Instant::now(),
        };
        match settling.file(ReturnKey::of_returned(&returned), own, ahead) {
            Filed::Own(reply) => Some(reply),
            Filed::Acked(acked, reply) => {
                self.unroutable(&acked.ticket, &reply, &acked.span).await;
                None
            }
            Filed::Ahead => None,
        }
    }

    /// A job the broker returned: kept, its failure recorded, retried with backoff.
    async fn unroutable(&self, ticket: &Ticket, reply: &str, span: &Span) {
        let lease = &ticket.lease;
        if self
            .warnings
            .admit(lease.topic.as_str(), "unroutable jobs retried", reply)
        {
            tracing::warn!(topic = %lease.topic, id = %lease.id, %reply, "job unroutable (no queue bound for its topic); kept and retried");
        }
        let reason = match ticket.expired {
            // The expired exchange has no queue bound for the topic.
            Some(_) => format!("expired, and unroutable: {reply}"),
            None => format!("unroutable: {reply}"),
        };
        telemetry::record_outcome(span, "returned", Some(&reason));
        self.settler.retry(ticket, "unroutable", &reason).await;
    }

    /// Releases the acked jobs settled by `now` (their window permits return only
    /// afterwards), and gives up on returns that matched nothing for too long.
    async fn release_settled(&self, settling: &mut Settling, now: Instant) {
        let (settled, orphans) = settling.settled(now);
        if !settled.is_empty() {
            let mut spans = Vec::new();
            let (tickets, permits): (Vec<Ticket>, Vec<OwnedSemaphorePermit>) = settled
                .into_iter()
                .map(|acked| {
                    if !acked.span.is_none() {
                        spans.push(acked.span);
                    }
                    (acked.ticket, acked.permit)
                })
                .unzip();
            self.settler.release(&tickets).await;
            drop(permits);
            for span in spans {
                telemetry::record_outcome(&span, "confirmed", None);
            }
        }
        for orphan in orphans {
            tracing::error!(topic = %orphan.topic, id = %orphan.id, reply = %orphan.reply, "the broker returned a job this bridge had already released as delivered; it may be lost");
        }
    }
}

/// Where a return seen with a confirm belongs.
enum Filed {
    /// To the publish whose confirm carried it (its reply text).
    Own(String),
    /// To a job acked before, not released yet: taken out, to be failed.
    Acked(Box<Acked>, String),
    /// To a publish whose confirm is still to come.
    Ahead,
}

impl Settling {
    fn file(&mut self, key: ReturnKey, own: ReturnKey, ahead: Ahead) -> Filed {
        if key == own {
            return Filed::Own(ahead.reply);
        }
        match self.acked.iter().position(|acked| acked.key == key) {
            Some(at) => Filed::Acked(Box::new(self.acked.remove(at)), ahead.reply),
            None => {
                self.ahead.insert(key, ahead);
                Filed::Ahead
            }
        }
    }

    /// When to release once caught up with the confirms: all acked jobs have settled,
    /// or the oldest has waited [`MAX_HOLD`]; `None` with nothing acked.
    fn release_at(&self) -> Option<Instant> {
        let (oldest, newest) = (self.acked.first()?, self.acked.last()?);
        Some((newest.seen + SETTLE).min(oldest.seen + MAX_HOLD))
    }

    fn held_too_long(&self, now: Instant) -> bool {
        self.acked
            .first()
            .is_some_and(|oldest| oldest.seen + MAX_HOLD <= now)
    }

    /// The acked jobs settled by `now`, taken out in ack order, and the returns kept
    /// ahead for [`ORPHAN_AFTER`] that no confirm claimed.
    fn settled(&mut self, now: Instant) -> (Vec<Acked>, Vec<Ahead>) {
        let settled = self
            .acked
            .partition_point(|acked| acked.seen + SETTLE <= now);
        let released = self.acked.drain(..settled).collect();
        let orphans = self
            .ahead
            .extract_if(|_, ahead| ahead.seen + ORPHAN_AFTER <= now)
            .map(|(_, ahead)| ahead)
            .collect();
        (released, orphans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Topic;
    use crate::store::Lease;

    fn acked(n: u64, seen: Instant) -> Acked {
        Acked {
            ticket: Ticket {
                lease: Lease {
                    topic: Topic::new("t").unwrap(),
                    id: format!("job-{n}"),
                    token: n,
                },
                schedule: None,
                due_at: 0,
                scheduled_at: 0,
                jitter_ms: 0,
                attempt: 1,
                note: String::new(),
                expired: None,
            },
            key: ReturnKey(n),
            permit: Arc::new(tokio::sync::Semaphore::new(1))
                .try_acquire_owned()
                .expect("a free permit"),
            seen,
            span: Span::none(),
        }
    }

    fn returned(reply: &str, seen: Instant) -> Ahead {
        Ahead {
            reply: reply.into(),
            topic: "t".into(),
            id: "x".into(),
            seen,
        }
    }

    #[test]
    fn a_return_finds_its_job_whichever_confirm_carries_it() {
        let now = Instant::now();
        let mut settling = Settling::default();
        // Its own confirm.
        let own = settling.file(ReturnKey(1), ReturnKey(1), returned("NO_ROUTE", now));
        assert!(matches!(own, Filed::Own(reply) if reply == "NO_ROUTE"));
        // A later job's confirm: the acked job is taken out, to be failed.
        settling.acked.push(acked(2, now));
        settling.acked.push(acked(3, now));
        let later = settling.file(ReturnKey(2), ReturnKey(4), returned("NO_ROUTE", now));
        assert!(matches!(later, Filed::Acked(job, _) if job.ticket.lease.id == "job-2"));
        assert_eq!(settling.acked.len(), 1);
        // An earlier job's confirm: kept until its own confirm comes.
        let earlier = settling.file(ReturnKey(5), ReturnKey(3), returned("NO_ROUTE", now));
        assert!(matches!(earlier, Filed::Ahead));
        assert!(settling.ahead.contains_key(&ReturnKey(5)));
    }

    #[test]
    fn acked_jobs_settle_in_order_and_unclaimed_returns_become_orphans() {
        let start = Instant::now();
        let mut settling = Settling::default();
        settling.acked.push(acked(1, start));
        settling.acked.push(acked(2, start + SETTLE));
        settling.file(ReturnKey(9), ReturnKey(1), returned("NO_ROUTE", start));
        let (released, orphans) = settling.settled(start + SETTLE);
        assert_eq!(released.len(), 1, "only what settled");
        assert_eq!(released[0].ticket.lease.id, "job-1");
        assert!(orphans.is_empty());
        let (released, orphans) = settling.settled(start + ORPHAN_AFTER);
        assert_eq!(released.len(), 1);
        assert_eq!(orphans.len(), 1);
        assert!(settling.ahead.is_empty() && settling.acked.is_empty());
    }

    #[test]
    fn a_release_waits_for_all_to_settle_but_never_past_the_longest_hold() {
        let start = Instant::now();
        let mut settling = Settling::default();
        assert_eq!(settling.release_at(), None);
        settling.acked.push(acked(1, start));
        assert_eq!(settling.release_at(), Some(start + SETTLE));
        // Acks keep coming: the release waits for the newest to settle ...
        settling
            .acked
            .push(acked(2, start + Duration::from_millis(4)));
        let newest_settled = start + Duration::from_millis(4) + SETTLE;
        assert_eq!(settling.release_at(), Some(newest_settled));
        // ... but not past the oldest's longest hold.
        settling
            .acked
            .push(acked(3, start + MAX_HOLD - Duration::from_millis(1)));
        assert_eq!(settling.release_at(), Some(start + MAX_HOLD));
        assert!(!settling.held_too_long(start + MAX_HOLD - Duration::from_millis(1)));
        assert!(settling.held_too_long(start + MAX_HOLD));
    }
}

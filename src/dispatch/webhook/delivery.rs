//! One webhook request, in a task of its own, read top to bottom: the request a job
//! becomes (prepare), the POST (call), its outcome reported to the settle module
//! (handle): a 2xx released in a batch with others ([`Releases`]), a refused job URL
//! parked, any other failure handed back after its backoff (or `Retry-After`, if later).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hyper::body::Bytes;
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tracing::Span;

use super::client::{Client, Delivered, Failure};
use super::health::{judge, Health};
use super::request::Outgoing;
use crate::dispatch::reserve::{Reserved, Ticket};
use crate::dispatch::settle::Settler;
use crate::job::trace::TraceContext;
use crate::metrics::TargetMeter;
use crate::telemetry::{self, Via};

/// A reserved job on its way to its target.
pub(super) struct Delivery {
    pub(super) client: Arc<Client>,
    pub(super) meter: Arc<TargetMeter>,
    pub(super) reserved: Reserved,
    pub(super) settler: Arc<Settler>,
    /// Signalled when the request ends and frees its slot.
    pub(super) room: Arc<Notify>,
    pub(super) releases: Arc<Releases>,
    pub(super) health: Arc<Health>,
    /// The target's index in the sink, for its health.
    pub(super) index: usize,
    /// The half-open target's one probe request.
    pub(super) probe: bool,
}

impl Delivery {
    /// Runs the request, holding `slot` until its answer (a failure: until its retry is
    /// recorded); a delivered job's release follows, batched.
    pub(super) async fn run(self, slot: OwnedSemaphorePermit) {
        let Self {
            client,
            meter,
            mut reserved,
            settler,
            room,
            releases,
            health,
            index,
            probe,
        } = self;
        let props = reserved.take_properties();
        let via = Via::Webhook {
            target: &client.target.name,
        };
        let span = telemetry::delivery_span(props.headers().as_ref(), &reserved.attempt_via(via));
        let trace = telemetry::outgoing(&span, TraceContext::of_props(&props));
        // Moved, not copied: the request shares these bytes.
        let body = Bytes::from(std::mem::take(&mut reserved.job.body));
        let Reserved { job, ticket, .. } = reserved;
        let outgoing = Outgoing {
            topic: ticket.lease.topic.as_str(),
            id: &job.id,
            due_at: ticket.due_at,
            scheduled_at: ticket.scheduled_at,
            attempt: job.attempt,
            body: &body,
            props: &props,
            trace: trace.as_ref(),
        };
        meter.started();
        let (result, took, to_target) = client.post(&outgoing).await;
        // Only the target's own URL tells of its health (before the slot frees, so the
        // next round sees a failure).
        if to_target {
            health.outcome(index, probe, judge(&result));
        }
        record_answer(&span, &result);
        drop(span);
        let seconds = took.as_secs_f64();
        let delivered = match result {
            Ok(delivered) => Some(answered(&meter, delivered, seconds, ticket)),
            Err(failure) => {
                meter.finished(
                    failure.code,
                    &status_of(&failure),
                    Some(failure.reason.clone()),
                    seconds,
                );
                tracing::debug!(target = %client.target.name, topic = %ticket.lease.topic, id = %job.id, reason = %failure.reason, "webhook delivery failed; retried");
                failed(&settler, &ticket, &failure).await;
                None
            }
        };
        // The request is over (a failure's retry recorded): its slot serves the next
        // job, while a delivered one waits for its release.
        drop(slot);
        room.notify_one();
        if let Some(ticket) = delivered {
            releases.release(&settler, ticket).await;
        }
    }
}

/// A 2xx: counted, and the ticket noted `HTTP <status>` for its history entry.
fn answered(meter: &TargetMeter, delivered: Delivered, seconds: f64, ticket: Ticket) -> Ticket {
    let mut status = itoa::Buffer::new();
    meter.finished("2xx", status.format(delivered.status), None, seconds);
    Ticket {
        note: format!("HTTP {}", delivered.status),
        ..ticket
    }
}

/// How the attempt ended, on its delivery span (nothing to do unless exported).
fn record_answer(span: &Span, result: &Result<Delivered, Failure>) {
    if span.is_none() {
        return;
    }
    let (status, outcome, failure) = match result {
        Ok(delivered) => (Some(delivered.status), "delivered", None),
        Err(failure) if failure.is_refusal() => (failure.status, "parked", Some(failure)),
        Err(failure) => (failure.status, "retried", Some(failure)),
    };
    if let Some(status) = status {
        telemetry::record_http_status(span, status);
    }
    telemetry::record_outcome(span, outcome, failure.map(|f| f.reason.as_str()));
}

/// The failure's HTTP status, or its code when there was no answer.
fn status_of(failure: &Failure) -> String {
    failure
        .status
        .map_or_else(|| failure.code.to_owned(), |s| s.to_string())
}

/// A failed request: parked if no retry can mend it (its URL refused), else handed
/// back after its backoff; `Retry-After` says "not before", never earlier than that.
async fn failed(settler: &Settler, ticket: &Ticket, failure: &Failure) {
    if failure.is_refusal() {
        settler.park(&ticket.lease, &failure.reason).await;
        return;
    }
    let cap = Duration::from_millis(settler.config.dispatch.retry_max_ms);
    let delay = settler
        .retry_delay(ticket.attempt)
        .max(failure.retry_after.map_or(Duration::ZERO, |d| d.min(cap)));
    settler
        .fail(&ticket.lease, delay, "webhook", &failure.reason)
        .await;
}

/// Delivered jobs waiting for their release, and whether a request's task is releasing
/// now. Releases go to Redis in batches: the task that finds none running releases
/// everything that has gathered (its own job first), looping until nothing is left; a
/// request that ends meanwhile only adds its job. One `release.lua` round trip per job
/// made the store the bottleneck (the AMQP sink batches its confirms the same way). A
/// job gives its slot back when its answer comes, not when its release does: a slot
/// bounds requests in flight, and the release round trip no longer idles it (jobs
/// reserved at once: `max_in_flight` plus the delivered ones of the release running).
#[derive(Debug, Default)]
pub(super) struct Releases {
    pending: Mutex<(Vec<Ticket>, bool)>,
}

impl Releases {
    fn lock(&self) -> MutexGuard<'_, (Vec<Ticket>, bool)> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn release(&self, settler: &Settler, done: Ticket) {
        {
            let mut pending = self.lock();
            pending.0.push(done);
            if pending.1 {
                return;
            }
            pending.1 = true;
        }
        loop {
            let batch = {
                let mut pending = self.lock();
                if pending.0.is_empty() {
                    pending.1 = false;
                    return;
                }
                std::mem::take(&mut pending.0)
            };
            settler.release(&batch).await;
        }
    }
}

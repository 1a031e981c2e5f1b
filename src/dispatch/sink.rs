//! The dispatch sink seam. Dispatch plans, reserves and hands each reserved job to the
//! sink its topic routes to; the sink delivers it and reports the outcome to
//! [`super::settle::Settler`] (release after a broker ack without return / after a
//! 2xx; hand back with backoff otherwise). Two sinks exist:
//!
//! - AMQP (`Dispatcher::dispatch_loop`, `publish` in `mod.rs` + `confirm.rs`), one loop
//!   per AMQP session: the ready exchange, publisher confirms, within the confirm
//!   window `dispatch.window`;
//! - webhooks (`Dispatcher::run_webhooks` + `webhook_sink.rs`), one loop for the whole
//!   process that needs no broker: `[[targets]]`, each with its own in-flight cap.
//!
//! Each loop plans only its own topics ([`Serves`]). A new sink: a route here, a module
//! that takes `(Ticket, ReservedJob)` and reports to the `Settler`, and a loop (or a
//! branch of one) that reserves for its topics only as many jobs as it can send now.

use super::settle::Ticket;
use crate::job::meta::{decode_meta, jitter_of};
use crate::job::schedule::Schedule;
use crate::job::Topic;
use crate::store::{Lease, ReservedJob};

/// Which loop plans a topic: the AMQP session's, or the webhook targets' (which runs
/// without the broker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Serves {
    Amqp,
    Webhooks,
}

/// Where a topic's due jobs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// The ready exchange (every topic no target matches).
    Amqp,
    /// The webhook target at this index of `[[targets]]`.
    Webhook(usize),
}

/// The settle ticket of a reserved job. A series occurrence is delivered only if its
/// next occurrence can be computed at release: a spec in another client's convention
/// is `Err` (the job's failure), with its lease.
///
/// A jittered series (`x-redisched-jitter` in its stored properties) is due at its
/// scheduled time (the record's `due_at`) plus the occurrence's delay: that is the
/// ticket's `due_at`. An occurrence reserved before that time was scheduled without
/// its delay (released by a bridge of the release before jitter, or re-indexed by
/// `check --repair` at its record's time): it is due at its scheduled time, never
/// reported later than it was due.
pub(crate) fn ticket(topic: &Topic, job: &ReservedJob) -> Result<Ticket, (Lease, String)> {
    let lease = Lease {
        topic: topic.clone(),
        id: job.id.clone(),
        token: job.token,
    };
    let schedule = match job.spec.as_deref().map(Schedule::from_spec) {
        None => None,
        Some(Ok(schedule)) => Some(schedule),
        Some(Err(err)) => return Err((lease, format!("unreadable schedule spec: {err}"))),
    };
    let jitter_ms = match &schedule {
        Some(_) => decode_meta(&job.meta).map_or(0, |props| jitter_of(&props)),
        None => 0,
    };
    let delay = match &schedule {
        Some(schedule) if jitter_ms > 0 => {
            schedule.occurrence_delay(topic.as_str(), &job.id, job.due_at, jitter_ms)
        }
        _ => 0,
    };
    let jittered = job.due_at.saturating_add(i64::try_from(delay).unwrap_or(0));
    Ok(Ticket {
        lease,
        schedule,
        due_at: if jittered <= job.reserved_at {
            jittered
        } else {
            job.due_at
        },
        scheduled_at: job.due_at,
        jitter_ms,
        attempt: job.attempt,
        note: String::new(),
        expired: None,
    })
}

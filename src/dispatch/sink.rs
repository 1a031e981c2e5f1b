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
use crate::job::Topic;
use crate::schedule::Schedule;
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
    Ok(Ticket {
        lease,
        schedule,
        due_at: job.due_at,
        attempt: job.attempt,
        note: String::new(),
        expired: None,
    })
}

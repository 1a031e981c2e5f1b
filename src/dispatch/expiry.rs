//! Expiry at dispatch, for both sinks. Right after a reserve, a job whose due time +
//! expires-after (its own `x-redisched-expires-after`, else its topic's `[[policies]]`
//! default; 0 = never) lies before the server's clock is not delivered: it is published
//! to the expired exchange instead (body and properties as a delivery would carry them,
//! plus `x-redisched-error`), and released only once the broker confirmed that copy
//! without returning it, logged `expired`. Nothing vanishes: until then it stays
//! reserved, and a failed copy hands it back.
//!
//! The AMQP loop publishes the copy on its own confirm channel, through its confirm
//! window like any job. The webhook loop runs without a broker: it borrows the channel
//! of the AMQP session while one is open (its confirms go to that session's confirmer,
//! the one place that can pair the channel's returns with their jobs), and while none
//! is, hands the job back with backoff (it expires at its next reservation, once the
//! broker is back).

use std::sync::{Mutex, PoisonError};

use lapin::options::BasicPublishOptions;
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, Channel, PublisherConfirm};
use tokio::sync::mpsc::UnboundedSender;

use super::confirm::{InFlight, ReturnKey};
use super::properties::outgoing_properties;
use super::settle::{Settler, Ticket};
use crate::job::headers;
use crate::job::Topic;
use crate::policy::Policies;
use crate::store::ReservedJob;

/// What dispatch needs to judge and set aside expired jobs; shared by the loops.
#[derive(Debug, Default)]
pub struct Expiry {
    policies: Policies,
    /// The AMQP dispatch session's confirm channel and confirmer while one is open.
    session: Mutex<Option<Session>>,
}

/// What the webhook loop borrows from the AMQP session to set expired jobs aside.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    pub channel: Channel,
    pub confirms: UnboundedSender<InFlight>,
}

impl Expiry {
    /// With the configuration's `[[policies]]` (their `expires_after_ms` defaults).
    pub fn new(policies: Policies) -> Self {
        Self {
            policies,
            session: Mutex::new(None),
        }
    }

    /// The job's expiry in ms (0 = never): its own header, else the topic's default. A
    /// stored value that cannot be read (another client's) counts as none.
    pub(crate) fn expires_after(&self, topic: &Topic, props: &AMQPProperties) -> u64 {
        match crate::job::expiry::of_job(props) {
            Ok(Some(ms)) => ms,
            Ok(None) => self.policies.expires_after_for(topic),
            Err(err) => {
                tracing::warn!(%topic, %err, "unreadable expiry header; the job does not expire");
                0
            }
        }
    }

    /// Whether any job of `topic` may expire without its own header: the webhook
    /// loop decodes a job's meta only when this or the meta may say so.
    fn may_expire(&self, topic: &Topic, meta: &[u8]) -> bool {
        self.policies.expires_after_for(topic) > 0
            || meta
                .windows(headers::EXPIRES_AFTER.len())
                .any(|w| w == headers::EXPIRES_AFTER.as_bytes())
    }

    /// The expiry of a reserved job due at `due_at` (its ticket's: the jittered time
    /// of a jittered occurrence) that expired at `now` (server clock), if it did.
    pub(crate) fn expired_at(
        &self,
        topic: &Topic,
        due_at: i64,
        props: &AMQPProperties,
        now: i64,
    ) -> Option<u64> {
        let ms = self.expires_after(topic, props);
        crate::job::expiry::is_expired(due_at, ms, now).then_some(ms)
    }

    pub(crate) fn set_session(&self, session: Option<Session>) {
        *self.session.lock().unwrap_or_else(PoisonError::into_inner) = session;
    }

    fn session(&self) -> Option<Session> {
        self.session
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|s| s.channel.status().connected())
    }

    /// The webhook loop's check of a reserved job: `false` when it is to be POSTed;
    /// `true` when it expired, and then it is being set aside (in a task of its own, so
    /// the loop goes on).
    pub(crate) fn take_expired(
        &self,
        exchange: &str,
        topic: &Topic,
        job: &ReservedJob,
        ticket: &Ticket,
        settler: &Settler,
    ) -> bool {
        if !self.may_expire(topic, &job.meta) {
            return false;
        }
        let props = crate::job::meta::decode_meta(&job.meta).unwrap_or_default();
        let Some(ms) = self.expired_at(topic, ticket.due_at, &props, settler.clock.now()) else {
            return false;
        };
        let ticket = mark_expired(ticket.clone(), ms);
        let settler = settler.clone();
        let session = self.session();
        let (exchange, topic, job) = (exchange.to_owned(), topic.clone(), job.clone());
        tokio::spawn(async move {
            let Some(session) = session else {
                tracing::debug!(%topic, id = %job.id, "expired job of a webhook topic: no broker channel to set it aside on; handed back");
                settler
                    .defer(&ticket.lease, settler.retry_delay(job.attempt))
                    .await;
                return;
            };
            let props = expired_properties(&topic, &job, props, ticket.due_at, ms);
            match publish(
                &session.channel,
                &exchange,
                &topic,
                &job,
                ticket.due_at,
                props,
            )
            .await
            {
                Ok((key, confirm)) => {
                    let flight = InFlight {
                        ticket,
                        key,
                        confirm,
                        permit: None,
                    };
                    if !flight.hand_to(&session.confirms, &settler.metrics) {
                        tracing::warn!(%topic, id = %job.id, "the session's confirmer has stopped; the expired job waits for its requeue");
                    }
                }
                Err(err) => {
                    tracing::warn!(%topic, id = %job.id, %err, "could not set an expired job aside; handed back");
                    settler
                        .defer(&ticket.lease, settler.retry_delay(job.attempt))
                        .await;
                }
            }
        });
        true
    }
}

/// The ticket of a job set aside as expired after `ms`.
pub(crate) fn mark_expired(ticket: Ticket, ms: u64) -> Ticket {
    let reason = crate::job::expiry::reason(ms);
    Ticket {
        note: reason
            .strip_prefix("expired: ")
            .unwrap_or(&reason)
            .to_owned(),
        expired: Some(ms),
        ..ticket
    }
}

/// What the expired exchange gets: the properties a delivery would carry, plus
/// `x-redisched-error` with the reason.
pub(crate) fn expired_properties(
    topic: &Topic,
    job: &ReservedJob,
    stored: AMQPProperties,
    due_at: i64,
    ms: u64,
) -> BasicProperties {
    let props = outgoing_properties(topic.as_str(), job, stored, due_at);
    let mut table = props.headers().clone().unwrap_or_default();
    table.insert(
        headers::ERROR.into(),
        AMQPValue::LongString(LongString::from(
            crate::job::expiry::reason(ms).into_bytes(),
        )),
    );
    props.with_headers(table)
}

/// Publishes `job` with `props` (from [`outgoing_properties`] with `due_at`) to
/// `exchange` (routing key = topic), `mandatory`; the key its return would carry, and
/// its confirm.
pub(crate) async fn publish(
    channel: &Channel,
    exchange: &str,
    topic: &Topic,
    job: &ReservedJob,
    due_at: i64,
    props: BasicProperties,
) -> lapin::Result<(ReturnKey, PublisherConfirm)> {
    let attempt_headers = [i64::from(job.attempt), due_at, job.due_at];
    let key = ReturnKey::of_publish(exchange, topic.as_str(), &props, attempt_headers);
    let confirm = channel
        .basic_publish(
            exchange.into(),
            topic.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &job.body,
            props,
        )
        .await?;
    Ok((key, confirm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Policy, TopicPattern};
    use lapin::types::FieldTable;

    fn with_header(value: Option<AMQPValue>) -> AMQPProperties {
        let mut table = FieldTable::default();
        if let Some(value) = value {
            table.insert(headers::EXPIRES_AFTER.into(), value);
        }
        AMQPProperties::default().with_headers(table)
    }

    #[test]
    fn the_jobs_own_header_wins_over_the_policy_and_zero_means_never() {
        let expiry = Expiry::new(Policies(vec![Policy {
            topics: vec![TopicPattern::new("mail.#").unwrap()],
            rate: None,
            expires_after_ms: 1_000,
        }]));
        let mail = Topic::new("mail.x").unwrap();
        let other = Topic::new("sms").unwrap();
        assert_eq!(expiry.expires_after(&mail, &with_header(None)), 1_000);
        let own = with_header(Some(AMQPValue::LongInt(50)));
        assert_eq!(expiry.expires_after(&mail, &own), 50);
        let never = with_header(Some(AMQPValue::LongInt(0)));
        assert_eq!(expiry.expires_after(&mail, &never), 0);
        assert_eq!(expiry.expires_after(&other, &with_header(None)), 0);
        // A stored value another client wrote badly: the job does not expire.
        let bad = with_header(Some(AMQPValue::Boolean(true)));
        assert_eq!(expiry.expires_after(&mail, &bad), 0);
        // The webhook loop's shortcut: decode only where expiry may apply.
        assert!(expiry.may_expire(&mail, b""));
        assert!(!expiry.may_expire(&other, b""));
        let meta = crate::job::meta::encode_meta(&own);
        assert!(expiry.may_expire(&other, &meta));
    }

    #[test]
    fn an_expired_ticket_carries_the_reason_as_its_note() {
        let ticket = Ticket {
            lease: crate::store::Lease {
                topic: Topic::new("t").unwrap(),
                id: "a".into(),
                token: 3,
            },
            schedule: None,
            due_at: 1_000,
            scheduled_at: 1_000,
            jitter_ms: 0,
            attempt: 2,
            note: String::new(),
            expired: None,
        };
        let marked = mark_expired(ticket, 250);
        assert_eq!(marked.expired, Some(250));
        assert_eq!(
            marked.note,
            "not delivered within 250 ms after its due time"
        );
        assert_eq!((marked.due_at, marked.attempt), (1_000, 2));
    }
}

//! One publish of a due job: the properties it carries, the `basic.publish` itself
//! (`mandatory`, on a confirm channel), and the key its return would carry
//! ([`ReturnKey`]). Used by the AMQP sink for the ready exchange and by the set-aside
//! for the expired exchange.
//!
//! A `basic.return` (the broker found no queue for a `mandatory` publish) carries no
//! delivery tag, and lapin may hand it to another publish's confirm (see
//! `confirm.rs`): so the confirmer matches each return to its job by the message
//! itself, through this key.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::LazyLock;

use lapin::message::BasicReturnMessage;
use lapin::options::BasicPublishOptions;
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, LongString, ShortString};
use lapin::{BasicProperties, Channel, PublisherConfirm};
use tracing::Span;

use crate::job::headers;
use crate::job::meta::integer;
use crate::job::Topic;
use crate::store::ReservedJob;
use crate::telemetry;

/// The properties a due job is published with: its stored ones, persistent, with the
/// job id as message_id and the `x-redisched-*` delivery headers. `due_at` is the time
/// the job was due (a series occurrence's jittered time), `job.due_at` its scheduled
/// time (`x-redisched-scheduled-at`). While spans are exported, the trace context is
/// the delivery `span`'s in place of the stored one (`telemetry::inject_amqp`).
pub(crate) fn outgoing_properties(
    topic: &str,
    job: &ReservedJob,
    stored: AMQPProperties,
    due_at: i64,
    span: &Span,
) -> BasicProperties {
    let mut table = stored.headers().clone().unwrap_or_default();
    telemetry::inject_amqp(span, &mut table);
    table.insert(
        headers::TOPIC.into(),
        AMQPValue::LongString(LongString::from(topic.as_bytes().to_vec())),
    );
    table.insert(headers::DUE_AT.into(), AMQPValue::LongLongInt(due_at));
    table.insert(
        headers::SCHEDULED_AT.into(),
        AMQPValue::LongLongInt(job.due_at),
    );
    table.insert(
        headers::ATTEMPT.into(),
        AMQPValue::LongLongInt(i64::from(job.attempt)),
    );
    let message_id = ShortString::try_new(job.id.clone())
        .unwrap_or_else(|_| ShortString::from(job.id.chars().take(64).collect::<String>()));
    stored
        .with_headers(table)
        .with_message_id(message_id)
        .with_delivery_mode(2)
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

/// What identifies a published job in the broker's return of it: exchange, routing key
/// (the topic), message id and the delivery headers of this one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ReturnKey(pub(super) u64);

impl ReturnKey {
    /// The key of a publish of `props` to `exchange` with `routing_key`, computed from
    /// what the broker returns verbatim.
    pub(crate) fn of(exchange: &str, routing_key: &str, props: &BasicProperties) -> Self {
        let table = props.headers().as_ref().map(|t| t.inner());
        let header = |name: &str| table.and_then(|t| t.get(name)).and_then(integer);
        Self::new(
            exchange,
            routing_key,
            props,
            [
                header(headers::ATTEMPT),
                header(headers::DUE_AT),
                header(headers::SCHEDULED_AT),
            ],
        )
    }

    /// [`ReturnKey::of`] for a publish whose `x-redisched-attempt`, `-due-at` and
    /// `-scheduled-at` headers are `attempt_headers`, known without looking them up.
    pub(crate) fn of_publish(
        exchange: &str,
        routing_key: &str,
        props: &BasicProperties,
        attempt_headers: [i64; 3],
    ) -> Self {
        Self::new(exchange, routing_key, props, attempt_headers.map(Some))
    }

    fn new(
        exchange: &str,
        routing_key: &str,
        props: &BasicProperties,
        attempt_headers: [Option<i64>; 3],
    ) -> Self {
        // FxHash, a few instructions a byte where SipHash took a thousand a publish,
        // seeded per process so that no producer can choose ids whose keys collide.
        static SEED: LazyLock<u64> =
            LazyLock::new(|| std::collections::hash_map::RandomState::new().hash_one(0u64));
        let mut hasher = rustc_hash::FxHasher::default();
        SEED.hash(&mut hasher);
        exchange.hash(&mut hasher);
        routing_key.hash(&mut hasher);
        props
            .message_id()
            .as_ref()
            .map(|id| id.as_str())
            .hash(&mut hasher);
        attempt_headers.hash(&mut hasher);
        Self(hasher.finish())
    }

    pub(crate) fn of_returned(returned: &BasicReturnMessage) -> Self {
        let delivery = &returned.delivery;
        Self::of(
            delivery.exchange.as_str(),
            delivery.routing_key.as_str(),
            &delivery.properties,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publish_knows_the_key_its_return_will_carry() {
        let job = ReservedJob {
            id: "job-1".into(),
            body: b"x".to_vec(),
            meta: Vec::new(),
            token: 7,
            attempt: 2,
            due_at: 1_700_000_000_000,
            reserved_at: 1_700_000_000_100,
            spec: None,
        };
        let due_at = job.due_at + 250;
        let props = outgoing_properties("t", &job, Default::default(), due_at, &Span::none());
        let known = [i64::from(job.attempt), due_at, job.due_at];
        assert_eq!(
            ReturnKey::of_publish("ready", "t", &props, known),
            ReturnKey::of("ready", "t", &props)
        );
        let other = [i64::from(job.attempt), due_at + 1, job.due_at];
        assert_ne!(
            ReturnKey::of_publish("ready", "t", &props, other),
            ReturnKey::of("ready", "t", &props)
        );
    }

    #[test]
    fn the_key_is_the_one_the_broker_returns_for_one_attempt() {
        let props = |attempt: i64| {
            let mut table = lapin::types::FieldTable::default();
            table.insert(headers::ATTEMPT.into(), AMQPValue::LongLongInt(attempt));
            BasicProperties::default()
                .with_message_id("job-1".into())
                .with_headers(table)
        };
        let key = ReturnKey::of("ready", "t", &props(1));
        assert_eq!(key, ReturnKey::of("ready", "t", &props(1)));
        assert_ne!(key, ReturnKey::of("ready", "t", &props(2)));
        assert_ne!(key, ReturnKey::of("expired", "t", &props(1)));
        assert_ne!(key, ReturnKey::of("ready", "u", &props(1)));
    }
}

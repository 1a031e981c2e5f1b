//! What identifies a published job in the broker's return of it.
//!
//! A `basic.return` (the broker found no queue for a `mandatory` publish) carries no
//! delivery tag, and lapin may hand it to another publish's confirm (see
//! `confirm.rs`): so the confirmer matches each return to its job by the message
//! itself, through this key.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::LazyLock;

use lapin::message::BasicReturnMessage;
use lapin::BasicProperties;

use crate::job::headers;
use crate::job::meta::integer;

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
    fn the_key_is_the_one_the_broker_returns_for_one_attempt() {
        let props = |attempt: i64| {
            let mut table = lapin::types::FieldTable::default();
            table.insert(
                headers::ATTEMPT.into(),
                lapin::types::AMQPValue::LongLongInt(attempt),
            );
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

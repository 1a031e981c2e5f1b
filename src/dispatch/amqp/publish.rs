//! One publish of a due job: the properties it carries and the `basic.publish` itself
//! (`mandatory`, on a confirm channel), with the key its return would carry. Used by
//! the AMQP sink for the ready exchange and by the set-aside for the expired exchange.

use lapin::options::BasicPublishOptions;
use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, LongString, ShortString};
use lapin::{BasicProperties, Channel, PublisherConfirm};

use super::return_key::ReturnKey;
use crate::job::headers;
use crate::job::Topic;
use crate::store::ReservedJob;

/// The properties a due job is published with: its stored ones, persistent, with the
/// job id as message_id and the `x-redisched-*` delivery headers. `due_at` is the time
/// the job was due (a series occurrence's jittered time), `job.due_at` its scheduled
/// time (`x-redisched-scheduled-at`).
pub(crate) fn outgoing_properties(
    topic: &str,
    job: &ReservedJob,
    stored: AMQPProperties,
    due_at: i64,
) -> BasicProperties {
    let mut table = stored.headers().clone().unwrap_or_default();
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
        let props = outgoing_properties("t", &job, Default::default(), due_at);
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
}

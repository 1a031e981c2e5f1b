//! The properties a due job is published with (the AMQP sink and the expired copy).

use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, LongString, ShortString};
use lapin::BasicProperties;

use crate::job::headers;
use crate::store::ReservedJob;

/// The properties a due job is published with: its stored ones, persistent, with the
/// job id as message_id and the `x-redisched-*` delivery headers. `due_at` is the time
/// the job was due (a series occurrence's jittered time), `job.due_at` its scheduled
/// time (`x-redisched-scheduled-at`).
pub fn outgoing_properties(
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

//! Turning one AMQP delivery into what it names and the store command it asks for, or
//! the reason it is invalid: [`Envelope::of`] here as the delivery is taken (topic, id,
//! op and reply address: enough to batch it and to answer it, known even when it is
//! invalid); then, once, as its batch is applied, its command: `put.rs` a put, replace
//! or delete ([`decode_parts`], the entry), through `names.rs` (topic, id, op, unknown
//! headers), `schedule.rs` (every, cron, tz, jitter), `due.rs` (the due time, a cron
//! series' first occurrence on the Redis clock the batch read first, if
//! [`needs_clock`]) and `value.rs` (a header value in the producer's terms);
//! `delete_prefix.rs` a `delete-prefix`. Nothing after decoding reads the delivery's
//! headers again (a set-aside only republishes them as they came).
//!
//! The rules are the wire contract (README, "Commands in"): routing key = topic,
//! `message_id` = job id, `x-redisched-op` = put | replace | delete | delete-prefix
//! (`message_id` = the id prefix), `x-delay` (ms) or
//! `x-deliver-at` (epoch ms) for the due time, body stored verbatim; a put or replace
//! may carry `x-redisched-every` or `x-redisched-cron` (+ `x-redisched-tz`) to make the
//! job a recurring series (README, "Recurring schedules over AMQP"). The combination
//! rule of the schedule headers is every face's
//! ([`crate::job::schedule::Schedule::from_parts`]).

mod delete_prefix;
mod due;
mod names;
mod put;
mod schedule;
mod value;

use lapin::message::Delivery;
use lapin::types::ShortString;
use lapin::BasicProperties;

use crate::job::headers;
use crate::job::meta::job_id;
use crate::store::Limits;
pub(super) use delete_prefix::decode_prefix_delete;
pub(super) use put::decode_command;
pub use put::decode_parts;
pub use schedule::needs_clock;

/// Why a command cannot be applied; becomes the `x-redisched-error` header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid(reason: impl Into<String>) -> Invalid {
    Invalid(reason.into())
}

/// What decoding checks a command against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    pub limits: Limits,
    /// `limits.min_interval_ms`: the shortest `x-redisched-every`.
    pub min_interval_ms: u64,
}

/// The op value that cancels every job of the topic whose id starts with `message_id`.
pub(super) const PREFIX_DELETE: &str = "delete-prefix";

/// What a delivery names and where its answer goes, known even when it is invalid: for
/// batching (the job it names), metrics, the live feed, the log and the reply.
#[derive(Debug)]
pub(super) struct Envelope {
    /// The routing key as given.
    pub topic: String,
    /// The job id (a `delete-prefix`: the id prefix) as given, if it could be read.
    pub id: Option<String>,
    /// The op as named in `x-redisched-op`, for metrics: `put` (also when absent),
    /// `replace`, `delete`, `delete-prefix`, or `unknown`.
    pub op_name: &'static str,
    /// Where to answer, if the producer asked (`reply_to`).
    pub reply: Option<ReplyTo>,
}

/// A command's reply address: `reply_to`, and the `correlation_id` the reply carries back.
#[derive(Debug, Clone)]
pub(super) struct ReplyTo {
    pub queue: ShortString,
    pub correlation_id: Option<ShortString>,
}

impl Envelope {
    /// What `delivery` names, read as it is taken (its command is decoded once its
    /// batch is applied).
    pub(super) fn of(delivery: &Delivery) -> Self {
        let props = &delivery.properties;
        Envelope {
            topic: delivery.routing_key.to_string(),
            id: job_id(props).ok().flatten(),
            op_name: op_name(props),
            reply: props.reply_to().as_ref().map(|queue| ReplyTo {
                queue: queue.clone(),
                correlation_id: props.correlation_id().clone(),
            }),
        }
    }
}

/// The op name a delivery asks for, for metrics and replies even when it is invalid.
fn op_name(props: &BasicProperties) -> &'static str {
    let value = props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::OP))
        .and_then(value::text);
    match value.as_deref() {
        None | Some("put") => "put",
        Some("replace") => "replace",
        Some("delete") => "delete",
        Some(PREFIX_DELETE) => PREFIX_DELETE,
        Some(_) => "unknown",
    }
}

/// What the tests of every decoding file share: a fixed "now", the rules, and commands
/// built from headers.
#[cfg(test)]
mod fixtures {
    use lapin::types::{AMQPValue, FieldTable, LongString};
    use lapin::BasicProperties;

    use super::{decode_parts, Invalid, Rules};
    use crate::job::Due;
    use crate::store::{Limits, Op};

    const LIMITS: Limits = Limits {
        max_delay_ms: 86_400_000,
        max_body_bytes: 16,
    };

    pub(super) const RULES: Rules = Rules {
        limits: LIMITS,
        min_interval_ms: 1000,
    };

    /// 2026-12-01T00:00:00Z, a Tuesday: the Redis server's clock as a batch read it.
    pub(super) const NOW: i64 = 1_796_083_200_000;

    /// The op a command decodes to (at [`NOW`]).
    pub(super) fn dp(topic: &str, props: &BasicProperties, body: &[u8]) -> Result<Op, Invalid> {
        decode_parts(topic, props, body, RULES, Some(NOW)).map(|c| c.op)
    }

    pub(super) fn props(headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), v.clone());
        }
        BasicProperties::default()
            .with_message_id("job-1".into())
            .with_headers(table)
    }

    pub(super) fn due(headers: &[(&str, AMQPValue)]) -> Result<Due, Invalid> {
        match dp("t", &props(headers), b"body")? {
            Op::Put(put) => Ok(put.due),
            Op::Delete { .. } => panic!("not a put"),
        }
    }

    pub(super) fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(v))
    }

    /// A command decoded at [`NOW`]: its due time and stored spec.
    pub(super) fn series(headers: &[(&str, AMQPValue)]) -> Result<(Due, Option<String>), Invalid> {
        let command = decode_parts("t", &props(headers), b"body", RULES, Some(NOW))?;
        match command.op {
            Op::Put(put) => Ok((
                put.due,
                command.schedule.map(|spec| spec.as_str().to_owned()),
            )),
            Op::Delete { .. } => panic!("not a put"),
        }
    }

    pub(super) fn refused(headers: &[(&str, AMQPValue)]) -> String {
        series(headers).expect_err("refused").0
    }
}

#[cfg(test)]
mod tests {
    use lapin::message::Delivery;
    use lapin::types::ShortString;

    use super::fixtures::{props, s};
    use super::Envelope;

    fn delivery(key: &str, props: lapin::BasicProperties) -> Delivery {
        let mut delivery = Delivery::mock(1, "".into(), key.into(), false, b"body".to_vec());
        delivery.properties = props;
        delivery
    }

    #[test]
    fn an_envelope_names_the_job_the_op_and_the_reply_even_when_invalid() {
        let asked = props(&[("x-redisched-op", s("replace"))])
            .with_reply_to("answers".into())
            .with_correlation_id("c-7".into());
        let envelope = Envelope::of(&delivery("orders", asked));
        assert_eq!(envelope.topic, "orders");
        assert_eq!(envelope.id.as_deref(), Some("job-1"));
        assert_eq!(envelope.op_name, "replace");
        let reply = envelope.reply.expect("a reply address");
        assert_eq!(reply.queue, ShortString::from("answers"));
        assert_eq!(reply.correlation_id, Some(ShortString::from("c-7")));
        for (op, named) in [
            (None, "put"),
            (Some("put"), "put"),
            (Some("delete"), "delete"),
            (Some("delete-prefix"), "delete-prefix"),
            (Some("upsert"), "unknown"),
        ] {
            let headers: Vec<_> = op.map(|op| ("x-redisched-op", s(op))).into_iter().collect();
            let envelope = Envelope::of(&delivery("a{b}", props(&headers)));
            assert_eq!(envelope.op_name, named);
            // An invalid topic is still named, for the metrics and the reply.
            assert_eq!(envelope.topic, "a{b}");
            assert!(envelope.reply.is_none());
        }
    }
}

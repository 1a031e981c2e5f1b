//! Turning one AMQP delivery into what it names and the store command it asks for, or
//! the reason it is invalid. Here, as the delivery is taken: [`Envelope::of`] (topic,
//! id, op, reply address, whether its command needs the Redis clock; known even when
//! it is invalid: enough to batch it and to answer it). Then once, as its batch is
//! applied, its command: `put.rs` a put, replace or delete ([`decode_parts`], what it
//! names, its body, meta and own URL) with `when.rs` (the due time, the schedule, and a
//! cron series' first occurrence on the Redis clock the batch read first);
//! `delete_prefix.rs` a `delete-prefix`; `value.rs` a header value read as text or
//! milliseconds and named in the producer's terms. Nothing after decoding reads the
//! delivery's headers again (a set-aside only republishes them as they came).
//!
//! The rules are the wire contract (`docs/src/amqp.md`, *Commands in*): routing key =
//! topic, `message_id` = job id, `x-redisched-op` = put | replace | delete |
//! delete-prefix (`message_id` = the id prefix), `x-delay` (ms) or `x-deliver-at` (epoch
//! ms) for the due time, body stored verbatim; a put or replace may carry
//! `x-redisched-every` or `x-redisched-cron` (+ `x-redisched-tz`) to make the job a
//! recurring series (`docs/src/recurring.md`, *Over AMQP*). The combination rule of the
//! schedule headers is every face's
//! ([`crate::job::schedule::Schedule::from_parts`]).

mod delete_prefix;
mod put;
mod value;
mod when;

use lapin::message::Delivery;
use lapin::types::ShortString;
use lapin::BasicProperties;
use tracing::Span;

use crate::job::headers;
use crate::job::meta::job_id;
use crate::store::Limits;
use crate::telemetry;
pub(super) use delete_prefix::decode_prefix_delete;
pub(super) use put::decode_command;
pub use put::decode_parts;

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
    /// Whether its command may need the Redis server's clock ([`needs_clock`]).
    pub needs_clock: bool,
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
            needs_clock: needs_clock(props),
        }
    }
}

/// A job a command names, as a hash of its topic and id: batches in flight together
/// name disjoint jobs, so commands on one job apply in delivery order, whatever order
/// the batches finish in. Taken from the topic and id a delivery names; two jobs whose
/// hashes collide only make a batch wait for the other, which is what a shared job
/// would do, so a collision costs time, never order.
pub(super) type JobKey = u64;

/// A delivery as taken from the queue, with what it names (its command is decoded
/// once its batch is applied).
#[derive(Debug)]
pub(super) struct Received {
    /// Acked once applied; republished as it came when set aside.
    pub delivery: Delivery,
    pub envelope: Envelope,
    /// Its ingest span, a child of the producer's (`Span::none()` unless exported):
    /// open from the take to the answer, which records the outcome.
    pub span: Span,
}

impl Received {
    pub(super) fn of(delivery: Delivery) -> Self {
        let envelope = Envelope::of(&delivery);
        let span = telemetry::ingest_span(
            delivery.properties.headers().as_ref(),
            &telemetry::Ingest {
                exchange: delivery.exchange.as_str(),
                routing_key: &envelope.topic,
                message_id: envelope.id.as_deref(),
            },
        );
        Self {
            envelope,
            delivery,
            span,
        }
    }

    /// Whether this is a `delete-prefix` (valid or not): such a command is applied on
    /// its own, between the commands before and after it.
    pub(super) fn is_prefix_delete(&self) -> bool {
        self.envelope.op_name == PREFIX_DELETE
    }

    /// The job this delivery names (none without a readable id: such a command is
    /// invalid and touches no job).
    pub(super) fn job_key(&self) -> Option<JobKey> {
        use std::hash::Hasher;
        let envelope = &self.envelope;
        let id = envelope.id.as_deref()?;
        // Fixed keys: the same job must hash the same in every batch.
        let mut hasher = std::hash::DefaultHasher::new();
        hasher.write(envelope.topic.as_bytes());
        hasher.write_u8(0xff);
        hasher.write(id.as_bytes());
        Some(hasher.finish())
    }
}

/// Whether decoding this delivery may need the Redis server's clock: a put or replace
/// (`x-redisched-op` absent, `put` or `replace`) naming `x-redisched-cron`, whose first
/// occurrence is a cron match on that clock. Read with the envelope as the delivery is
/// taken, so its batch reads `TIME` once before decoding, and only when it has a cron
/// series. It may say yes of a command that then turns out invalid, never no of a cron
/// series.
pub fn needs_clock(props: &BasicProperties) -> bool {
    let cron = props
        .headers()
        .as_ref()
        .is_some_and(|t| t.inner().contains_key(headers::CRON));
    cron && matches!(op_name(props), "put" | "replace")
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

    use lapin::types::AMQPValue;

    use super::fixtures::{props, s, series, NOW, RULES};
    use super::{decode_parts, invalid, needs_clock, Envelope};
    use crate::job::Due;
    use crate::store::Op;

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
        assert!(!envelope.needs_clock);
        let cron = props(&[("x-redisched-cron", s("0 9 * * *"))]);
        assert!(Envelope::of(&delivery("orders", cron)).needs_clock);
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

    #[test]
    fn a_batch_reads_the_clock_only_for_a_put_or_replace_naming_a_cron() {
        let cron = || ("x-redisched-cron", s("0 9 * * *"));
        assert!(needs_clock(&props(&[cron()])));
        assert!(needs_clock(&props(&[("x-redisched-op", s("put")), cron()])));
        assert!(needs_clock(&props(&[
            ("x-redisched-op", s("replace")),
            cron()
        ])));
        assert!(!needs_clock(&props(&[
            ("x-redisched-op", s("delete")),
            cron()
        ])));
        assert!(!needs_clock(&props(&[
            ("x-redisched-op", s("upsert")),
            cron()
        ])));
        let every = || ("x-redisched-every", AMQPValue::LongInt(5000));
        assert!(!needs_clock(&props(&[every()])));
        assert!(!needs_clock(&props(&[])));
        assert!(!needs_clock(&lapin::BasicProperties::default()));
        // Without the clock a cron series could not be placed: never no of one.
        let err = decode_parts("t", &props(&[cron()]), b"", RULES, None).expect_err("no clock");
        assert_eq!(
            err,
            invalid("internal: a cron series decoded without the Redis server's clock")
        );
        // Anything else decodes without it, as it would with it.
        for headers in [
            vec![every()],
            vec![],
            vec![("x-delay", AMQPValue::LongInt(5))],
        ] {
            let without = decode_parts("t", &props(&headers), b"", RULES, None);
            let with = decode_parts("t", &props(&headers), b"", RULES, Some(NOW));
            assert_eq!(without, with);
            assert!(matches!(without.map(|c| c.op), Ok(Op::Put(_))));
        }
        assert!(matches!(
            series(&[cron()]).map(|(due, _)| due),
            Ok(Due::At(at)) if at > NOW
        ));
    }
}

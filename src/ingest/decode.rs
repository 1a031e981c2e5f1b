//! Turning one AMQP delivery into a store command, or into the reason it is invalid,
//! once: [`decode`] reads every header a command may carry and yields an [`Incoming`]
//! holding what the rest of ingest needs (op, topic, id, schedule, reply address), so
//! nothing after it reads the delivery's headers again (a set-aside only republishes
//! them as they came).
//!
//! The rules are the wire contract (README, "Commands in"): routing key = topic,
//! `message_id` = job id, `x-redisched-op` = put | replace | delete | delete-prefix
//! (`message_id` = the id prefix), `x-delay` (ms) or
//! `x-deliver-at` (epoch ms) for the due time, body stored verbatim; a put or replace
//! may carry `x-redisched-every` or `x-redisched-cron` (+ `x-redisched-tz`) to make the
//! job a recurring series (README, "Recurring schedules over AMQP"). The combination
//! rule of the schedule headers is every face's ([`Schedule::from_parts`]).

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;

use crate::job::float_millis;
use crate::job::headers;
use crate::job::meta::{encode_meta, forwardable, integer, job_id, too_deep, with_plugin_delay};
use crate::job::schedule::{parse_jitter, PartsError, Schedule, ScheduleParts};
use crate::job::{Due, IdPrefix, JobId, PutMode, Topic};
use crate::store::{Command, Limits, Op, PutRequest};
use crate::targets::TargetConfig;

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

/// One delivery as decoded: what it names and where its answer goes, and its command
/// (the store's work) or why it is set aside.
#[derive(Debug)]
pub(super) struct Incoming {
    pub envelope: Envelope,
    pub command: Result<Request, Invalid>,
}

/// What a delivery names and where its answer goes, known even when it is invalid: for
/// metrics, the live feed, the log and the reply.
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

/// A valid command, by how it is applied.
#[derive(Debug)]
pub(super) enum Request {
    /// A put, replace or delete: applied in a batch, after [`Decoded::resolve`].
    Batched(Decoded),
    /// A `delete-prefix`: applied on its own, between the commands before and after it.
    PrefixDelete { topic: Topic, prefix: IdPrefix },
}

/// Decodes a delivery once (see the module docs). A put naming its own URL
/// (`x-redisched-url`) is checked against `targets` here too (`crate::targets::check_job_url_for`).
pub(super) fn decode(delivery: &Delivery, rules: Rules, targets: &[TargetConfig]) -> Incoming {
    let props = &delivery.properties;
    let op_name = op_name(props);
    let command = if op_name == PREFIX_DELETE {
        decode_prefix_delete(delivery)
            .map(|(topic, prefix)| Request::PrefixDelete { topic, prefix })
    } else {
        decode_parts(delivery.routing_key.as_str(), props, &delivery.data, rules)
            .and_then(|decoded| check_url(decoded, targets))
            .map(Request::Batched)
    };
    Incoming {
        envelope: Envelope {
            topic: delivery.routing_key.to_string(),
            id: job_id(props).ok().flatten(),
            op_name,
            reply: props.reply_to().as_ref().map(|queue| ReplyTo {
                queue: queue.clone(),
                correlation_id: props.correlation_id().clone(),
            }),
        },
        command,
    }
}

/// A put's own URL checked at the door (`crate::targets::check_job_url_for`); deletes and puts without one pass.
fn check_url(decoded: Decoded, targets: &[TargetConfig]) -> Result<Decoded, Invalid> {
    if let (Op::Put(put), Some(url)) = (&decoded.op, decoded.url.as_deref()) {
        crate::targets::check_job_url_for(targets, put.topic.as_str(), url)
            .map_err(|reason| invalid(format!("{}: {reason}", headers::URL)))?;
    }
    Ok(decoded)
}

/// The op a command asks for, as named in `x-redisched-op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpName {
    Put,
    Replace,
    Delete,
}

/// A decoded put, replace or delete. A cron series still needs "now" (the Redis
/// server's clock) for its first occurrence: that is the one step left after decoding,
/// [`Decoded::resolve`] ([`Decoded::needs_now`] says whether it reads the clock; ingest
/// asks Redis once per batch that has any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    op: Op,
    schedule: Option<Schedule>,
    /// A cron series' first occurrence, found once the server's clock is known:
    /// `Some(x-delay / x-deliver-at as given, if any)`; `None` for anything else.
    cron_start: Option<Option<Due>>,
    /// `x-redisched-jitter` (ms, checked against the schedule), 0 for none.
    jitter_ms: u64,
    /// A put's `x-redisched-url` (checked against the targets by `crate::targets::check_job_url_for`).
    url: Option<String>,
}

impl Decoded {
    pub fn op(&self) -> &Op {
        &self.op
    }

    pub fn schedule(&self) -> Option<&Schedule> {
        self.schedule.as_ref()
    }

    /// A put's own URL (`x-redisched-url`), if it names one.
    pub fn url(&self) -> Option<&str> {
        self.url.as_deref()
    }

    /// Whether [`Decoded::resolve`] needs the server's clock (a cron series).
    pub fn needs_now(&self) -> bool {
        self.cron_start.is_some()
    }

    /// The store command; `now_ms` is the Redis server's clock (only read for a cron
    /// series: its first occurrence is a match at or after the computed start, so it is
    /// never before what the producer asked for).
    pub fn resolve(self, now_ms: i64) -> Result<Command, Invalid> {
        let Decoded {
            mut op,
            schedule,
            cron_start,
            jitter_ms,
            url: _,
        } = self;
        if let (Some(start), Some(schedule), Op::Put(put)) = (cron_start, &schedule, &mut op) {
            // The one rule of every face (`Schedule::first_due`): the first match at or
            // after the requested start, which is never before now.
            let first = schedule.first_due(start, now_ms).map_err(|_| {
                invalid(format!(
                    "{} {:?} has no occurrence after the requested start",
                    headers::CRON,
                    schedule.cron_expr().unwrap_or_default()
                ))
            })?;
            put.due = first;
        }
        // The first occurrence's delay is bounded by the gap to the next one; put.lua
        // computes it once it has resolved the due time (an interval's delay, too).
        let jitter_ms = match (&schedule, &op) {
            (Some(schedule), Op::Put(put)) if jitter_ms > 0 => match put.due {
                Due::At(first) => schedule.jitter_bound(first, jitter_ms),
                Due::Delay(_) => jitter_ms,
            },
            _ => 0,
        };
        let schedule = match &schedule {
            Some(schedule) => Some(schedule.store_spec().map_err(|e| invalid(e.to_string()))?),
            None => None,
        };
        Ok(Command {
            op,
            schedule,
            jitter_ms,
        })
    }
}

/// The op value that cancels every job of the topic whose id starts with `message_id`.
pub(super) const PREFIX_DELETE: &str = "delete-prefix";

/// A `delete-prefix` command: the topic (routing key) and the id prefix (`message_id`,
/// or `x-redisched-id`), at least [`crate::job::MIN_PREFIX_CHARS`] characters (there is no forcing
/// over AMQP: a shorter prefix is almost always a mistake, and the CLI and REST can
/// force one).
fn decode_prefix_delete(delivery: &Delivery) -> Result<(Topic, IdPrefix), Invalid> {
    let props = &delivery.properties;
    if let Some(reason) = props.headers().as_ref().and_then(too_deep) {
        return Err(invalid(reason));
    }
    if let Some(table) = props.headers().as_ref() {
        refuse_unknown_headers(table)?;
    }
    let topic = Topic::new(delivery.routing_key.as_str())
        .map_err(|e| invalid(format!("bad topic (routing key): {e}")))?;
    let raw = job_id(props).map_err(invalid)?.ok_or_else(|| {
        invalid(format!(
            "missing message_id (or header {}): a {PREFIX_DELETE} carries the id prefix there",
            headers::ID
        ))
    })?;
    let prefix = IdPrefix::new(raw, false).map_err(|e| invalid(e.to_string()))?;
    Ok((topic, prefix))
}

/// Decodes a put, replace or delete from its parts, in the wire table's order, each
/// header refused in the producer's terms: the ids and the op, then (a put or replace)
/// the schedule, the due time and the body, and the properties stored with the job.
pub fn decode_parts(
    routing_key: &str,
    props: &BasicProperties,
    body: &[u8],
    rules: Rules,
) -> Result<Decoded, Invalid> {
    // First: everything below clones, encodes or compares header values, which recurses
    // once per nesting level.
    if let Some(reason) = props.headers().as_ref().and_then(too_deep) {
        return Err(invalid(reason));
    }
    let (topic, id) = topic_and_id(routing_key, props)?;
    let table = props.headers().as_ref();
    let header = |name: &str| table.and_then(|t| t.inner().get(name));
    if let Some(table) = table {
        refuse_unknown_headers(table)?;
    }
    let op = op_of(header(headers::OP))?;
    if op == OpName::Delete {
        return Ok(Decoded {
            op: Op::Delete { topic, id },
            schedule: None,
            cron_start: None,
            jitter_ms: 0,
            url: None,
        });
    }
    // Kept in the stored properties as given (dispatch reads it there); checked here so
    // a bad value is set aside at the door, not found at delivery.
    if let Some(value) = header(headers::EXPIRES_AFTER) {
        crate::job::expiry::from_header(value).map_err(|e| invalid(e.0))?;
    }
    let recurring = schedule(table, rules.min_interval_ms)?;
    let given = due_of(
        header(headers::DELAY),
        header(headers::DELIVER_AT),
        rules.limits,
    )?;
    if body.len() > rules.limits.max_body_bytes {
        return Err(invalid(format!(
            "body is {} bytes, the limit is {}",
            body.len(),
            rules.limits.max_body_bytes
        )));
    }
    let (schedule, jitter_ms) = match recurring {
        Some((schedule, jitter_ms)) => (Some(schedule), jitter_ms),
        None => (None, 0),
    };
    let (due, cron_start) = first_due(schedule.as_ref(), given);
    let delivered = match due {
        // As the delayed-message plugin does: consumers written for it read x-delay.
        // Not for a series: its later occurrences were never delayed by that much.
        Due::Delay(ms) if schedule.is_none() && header(headers::DELAY).is_some() => {
            with_plugin_delay(forwardable(props), ms)
        }
        _ => forwardable(props),
    };
    let url = header(headers::URL).map(url_of).transpose()?;
    Ok(Decoded {
        op: Op::Put(PutRequest {
            topic,
            id,
            body: body.to_vec(),
            meta: encode_meta(&delivered),
            due,
            mode: if op == OpName::Replace {
                PutMode::Replace
            } else {
                PutMode::Keep
            },
        }),
        schedule,
        cron_start,
        jitter_ms,
        url,
    })
}

/// The topic (routing key) and the job id (`message_id`, or `x-redisched-id`).
fn topic_and_id(routing_key: &str, props: &BasicProperties) -> Result<(Topic, JobId), Invalid> {
    let topic =
        Topic::new(routing_key).map_err(|e| invalid(format!("bad topic (routing key): {e}")))?;
    let id = job_id(props).map_err(invalid)?.ok_or_else(|| {
        invalid(format!(
            "missing message_id (or header {}): it carries the job id",
            headers::ID
        ))
    })?;
    let source = if props.message_id().is_some() {
        "message_id"
    } else {
        headers::ID
    };
    let id = JobId::new(&id).map_err(|e| invalid(format!("bad {source}: {e}")))?;
    Ok((topic, id))
}

/// `x-redisched-op` of a batched command (a `delete-prefix` never reaches here).
fn op_of(value: Option<&AMQPValue>) -> Result<OpName, Invalid> {
    let Some(value) = value else {
        return Ok(OpName::Put);
    };
    match text(value).as_deref() {
        Some("put") => Ok(OpName::Put),
        Some("replace") => Ok(OpName::Replace),
        Some("delete") => Ok(OpName::Delete),
        Some(PREFIX_DELETE) => Err(invalid(format!(
            "internal: {PREFIX_DELETE} is applied on its own, not in a batch"
        ))),
        _ => Err(invalid(format!(
            "unknown {}: {} (expected put, replace, delete or {PREFIX_DELETE})",
            headers::OP,
            show(value)
        ))),
    }
}

/// The due time asked for: `x-delay` (at most `limits.max_delay_ms`) or `x-deliver-at`,
/// never both; `None` for neither.
fn due_of(
    delay: Option<&AMQPValue>,
    deliver_at: Option<&AMQPValue>,
    limits: Limits,
) -> Result<Option<Due>, Invalid> {
    match (delay, deliver_at) {
        (Some(_), Some(_)) => Err(invalid(format!(
            "both {} and {} are set; give one",
            headers::DELAY,
            headers::DELIVER_AT
        ))),
        (Some(delay), None) => {
            let (ms, given) = millis(delay, headers::DELAY)?;
            let due = Due::delay(headers::DELAY, &given, ms).map_err(|e| invalid(e.to_string()))?;
            if ms > i128::from(limits.max_delay_ms) {
                return Err(invalid(format!(
                    "{} {given} ms exceeds the maximum delay of {} ms",
                    headers::DELAY,
                    limits.max_delay_ms
                )));
            }
            Ok(Some(due))
        }
        (None, Some(at)) => {
            let (ms, given) = millis(at, headers::DELIVER_AT)?;
            Due::at(headers::DELIVER_AT, &given, ms)
                .map(Some)
                .map_err(|e| invalid(e.to_string()))
        }
        (None, None) => Ok(None),
    }
}

/// The first occurrence of a put: as given, else now; for a series as given, else one
/// interval from now. A cron series' is found once the server's clock is known
/// ([`Decoded::resolve`]): `Some(the start as given)` in the second place.
fn first_due(schedule: Option<&Schedule>, given: Option<Due>) -> (Due, Option<Option<Due>>) {
    match (schedule, given) {
        (Some(Schedule::Every { ms }), None) => {
            (Due::Delay(i64::try_from(*ms).unwrap_or(i64::MAX)), None)
        }
        (Some(Schedule::Cron { .. }), given) => (Due::NOW, Some(given)),
        (_, given) => (given.unwrap_or(Due::NOW), None),
    }
}

/// `x-redisched-url` as text (its prefix is checked against the targets by `crate::targets::check_job_url_for`).
fn url_of(value: &AMQPValue) -> Result<String, Invalid> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .map(str::to_owned)
            .map_err(|_| invalid(format!("{} is not UTF-8 text", headers::URL))),
        AMQPValue::ShortString(s) => Ok(s.as_str().to_owned()),
        _ => Err(invalid(format!("{} must be a text header", headers::URL))),
    }
}

/// Refuses any `x-redisched-*` header (any case) the bridge does not know.
fn refuse_unknown_headers(table: &FieldTable) -> Result<(), Invalid> {
    let mut unknown: Vec<&str> = table
        .inner()
        .keys()
        .map(|key| key.as_str())
        .filter(|key| {
            key.get(..headers::PREFIX.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(headers::PREFIX))
                && !headers::KNOWN.contains(key)
        })
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort_unstable();
    Err(invalid(format!(
        "unknown header{} {} (a command may carry {}, {}, {}, {}, {}, {})",
        if unknown.len() == 1 { "" } else { "s" },
        unknown.join(", "),
        headers::OP,
        headers::ID,
        headers::EVERY,
        headers::CRON,
        headers::TZ,
        headers::JITTER,
    )))
}

/// The schedule and jitter a put or replace asks for, if any: the headers' values as
/// text (an integer of any AMQP width for `every` and `jitter`), then every face's rule
/// ([`Schedule::from_parts`]), its refusals named in header terms.
fn schedule(
    table: Option<&FieldTable>,
    min_interval_ms: u64,
) -> Result<Option<(Schedule, u64)>, Invalid> {
    let header = |name: &str| table.and_then(|t| t.inner().get(name));
    let millis_text = |name: &str| {
        match header(name) {
        None => Ok(None),
        Some(value) => match integer(value) {
            Some(ms) => Ok(Some(ms.to_string())),
            None => text(value).map(Some).ok_or_else(|| {
                invalid(format!(
                    "{name} must be an integer number of milliseconds (or a numeric string), got {}",
                    show(value)
                ))
            }),
        },
    }
    };
    let text_of = |name: &str, what: &str| match header(name) {
        None => Ok(None),
        Some(value) => text(value)
            .map(Some)
            .ok_or_else(|| invalid(format!("{name} must be a text {what}, got {}", show(value)))),
    };
    let every = millis_text(headers::EVERY)?;
    let cron = text_of(headers::CRON, "cron expression")?;
    let tz = text_of(headers::TZ, "IANA time zone name")?;
    let jitter = millis_text(headers::JITTER)?;
    let parts = ScheduleParts {
        every: every.as_deref(),
        cron: cron.as_deref(),
        tz: tz.as_deref(),
        jitter: jitter.as_deref(),
    };
    let named =
        |name: &str, e: crate::job::schedule::ScheduleError| invalid(format!("{name}: {e}"));
    match Schedule::from_parts(parts, min_interval_ms) {
        Ok(recurring) => Ok(recurring),
        Err(PartsError::BothEveryAndCron) => Err(invalid(format!(
            "both {} and {} are set; give one",
            headers::EVERY,
            headers::CRON
        ))),
        Err(PartsError::TzWithoutCron) => Err(invalid(format!(
            "{} is only used with {}",
            headers::TZ,
            headers::CRON
        ))),
        // Over AMQP a jitter of 0 on a one-shot job is accepted as none, as it always was.
        Err(PartsError::JitterWithoutSchedule) => {
            match parse_jitter(jitter.as_deref().unwrap_or_default()) {
                Ok(0) => Ok(None),
                Err(e) => Err(named(headers::JITTER, e)),
                Ok(_) => Err(invalid(format!(
                    "{} is only used with {} or {} (a one-shot job has no occurrences to spread)",
                    headers::JITTER,
                    headers::EVERY,
                    headers::CRON
                ))),
            }
        }
        Err(PartsError::Every(e)) => Err(named(headers::EVERY, e)),
        Err(PartsError::Cron(e)) => Err(named(headers::CRON, e)),
        Err(PartsError::Jitter(e)) => Err(named(headers::JITTER, e)),
    }
}

/// The op name a delivery asks for, for metrics and replies even when it is invalid.
fn op_name(props: &BasicProperties) -> &'static str {
    let value = props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::OP))
        .and_then(text);
    match value.as_deref() {
        None | Some("put") => "put",
        Some("replace") => "replace",
        Some("delete") => "delete",
        Some(PREFIX_DELETE) => PREFIX_DELETE,
        Some(_) => "unknown",
    }
}

/// Milliseconds from an integer of any AMQP width, a finite float (rounded up: a job
/// is never due early), or a numeric string; with the value as the user wrote it, for
/// messages. The range is checked by [`Due::delay`] / [`Due::at`].
fn millis(value: &AMQPValue, name: &str) -> Result<(i128, String), Invalid> {
    let bad = || {
        invalid(format!(
            "{name} must be an integer number of milliseconds (or a numeric string), got {}",
            show(value)
        ))
    };
    let int = |v: i64| Ok((i128::from(v), v.to_string()));
    match value {
        AMQPValue::ShortShortInt(v) => int(i64::from(*v)),
        AMQPValue::ShortShortUInt(v) => int(i64::from(*v)),
        AMQPValue::ShortInt(v) => int(i64::from(*v)),
        AMQPValue::ShortUInt(v) => int(i64::from(*v)),
        AMQPValue::LongInt(v) => int(i64::from(*v)),
        AMQPValue::LongUInt(v) => int(i64::from(*v)),
        AMQPValue::LongLongInt(v) => int(*v),
        // Debug keeps a float short as written (`1e300`, `2.5`).
        AMQPValue::Float(v) => Ok((
            float_millis(f64::from(*v)).ok_or_else(bad)?,
            format!("{v:?}"),
        )),
        AMQPValue::Double(v) => Ok((float_millis(*v).ok_or_else(bad)?, format!("{v:?}"))),
        AMQPValue::ShortString(_) | AMQPValue::LongString(_) => {
            let s = text(value).ok_or_else(bad)?;
            let s = s.trim();
            let ms = match s.parse::<i128>() {
                Ok(v) => v,
                Err(_) => s
                    .parse::<f64>()
                    .ok()
                    .and_then(float_millis)
                    .ok_or_else(bad)?,
            };
            Ok((ms, s.to_string()))
        }
        _ => Err(bad()),
    }
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// A non-string header value as a producer would name it (never the Rust debug form).
fn show_typed(value: &AMQPValue) -> String {
    match value {
        AMQPValue::Boolean(v) => format!("the boolean {v}"),
        AMQPValue::ShortShortInt(v) => v.to_string(),
        AMQPValue::ShortShortUInt(v) => v.to_string(),
        AMQPValue::ShortInt(v) => v.to_string(),
        AMQPValue::ShortUInt(v) => v.to_string(),
        AMQPValue::LongInt(v) => v.to_string(),
        AMQPValue::LongUInt(v) => v.to_string(),
        AMQPValue::LongLongInt(v) => v.to_string(),
        AMQPValue::Float(v) => format!("{v:?}"),
        AMQPValue::Double(v) => format!("{v:?}"),
        AMQPValue::DecimalValue(d) => format!("a decimal ({} with scale {})", d.value, d.scale),
        AMQPValue::Timestamp(v) => format!("the timestamp {v}"),
        AMQPValue::FieldArray(a) => format!("an array of {}", a.as_slice().len()),
        AMQPValue::FieldTable(t) => format!("a table of {}", t.inner().len()),
        AMQPValue::ByteArray(b) => format!("a byte array of {}", b.as_slice().len()),
        AMQPValue::Void => "an empty value".to_string(),
        AMQPValue::ShortString(s) => format!("{:?}", s.as_str()),
        AMQPValue::LongString(s) => format!("a {}-byte string", s.as_bytes().len()),
    }
}

/// A short, printable rendering of a header value for error messages.
fn show(value: &AMQPValue) -> String {
    let shown = match (text(value), value) {
        (Some(s), _) => format!("{s:?}"),
        // A string that is not UTF-8.
        (None, AMQPValue::LongString(s)) => format!("a {}-byte binary string", s.as_bytes().len()),
        (None, other) => show_typed(other),
    };
    if shown.len() > 80 {
        let cut = (0..=80)
            .rev()
            .find(|&i| shown.is_char_boundary(i))
            .unwrap_or(0);
        format!("{}…", &shown[..cut])
    } else {
        shown
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldTable, LongString};

    const LIMITS: Limits = Limits {
        max_delay_ms: 86_400_000,
        max_body_bytes: 16,
    };

    const RULES: Rules = Rules {
        limits: LIMITS,
        min_interval_ms: 1000,
    };

    /// The op a command decodes to (resolved at a fixed "now").
    fn dp(topic: &str, props: &BasicProperties, body: &[u8]) -> Result<Op, Invalid> {
        decode_parts(topic, props, body, RULES)
            .and_then(|d| d.resolve(NOW))
            .map(|c| c.op)
    }

    fn props(headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), v.clone());
        }
        BasicProperties::default()
            .with_message_id("job-1".into())
            .with_headers(table)
    }

    fn due(headers: &[(&str, AMQPValue)]) -> Result<Due, Invalid> {
        match dp("t", &props(headers), b"body")? {
            Op::Put(put) => Ok(put.due),
            Op::Delete { .. } => panic!("not a put"),
        }
    }

    /// 2026-12-01T00:00:00Z, a Tuesday.
    const NOW: i64 = 1_796_083_200_000;

    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(v))
    }

    #[test]
    fn delays_in_every_accepted_form() {
        assert_eq!(due(&[]), Ok(Due::NOW));
        assert_eq!(
            due(&[("x-delay", AMQPValue::LongInt(1500))]),
            Ok(Due::Delay(1500))
        );
        assert_eq!(
            due(&[("x-delay", AMQPValue::ShortShortUInt(7))]),
            Ok(Due::Delay(7))
        );
        assert_eq!(due(&[("x-delay", s(" 250 "))]), Ok(Due::Delay(250)));
        assert_eq!(
            due(&[("x-delay", AMQPValue::Double(1.2))]),
            Ok(Due::Delay(2)),
            "rounded up"
        );
        assert_eq!(due(&[("x-delay", s("2.5"))]), Ok(Due::Delay(3)));
        assert_eq!(
            due(&[("x-delay", AMQPValue::LongInt(-40))]),
            Ok(Due::Delay(0))
        );
        assert_eq!(
            due(&[("x-deliver-at", AMQPValue::LongLongInt(1_700_000_000_000))]),
            Ok(Due::At(1_700_000_000_000))
        );
    }

    #[test]
    fn bad_delays_are_refused_with_a_reason() {
        for bad in [
            s("soon"),
            s("NaN"),
            s("inf"),
            AMQPValue::Double(f64::NAN),
            AMQPValue::Boolean(true),
        ] {
            let err = due(&[("x-delay", bad.clone())]).expect_err("refused");
            assert!(err.0.contains("x-delay"), "{err} for {bad:?}");
        }
        let err = due(&[("x-delay", AMQPValue::LongLongInt(86_400_001))]).expect_err("too long");
        assert!(err.0.contains("exceeds the maximum delay"), "{err}");
        let err = due(&[("x-delay", AMQPValue::Double(1e300))]).expect_err("too long");
        assert!(
            err.0.contains("out of range") || err.0.contains("exceeds"),
            "{err}"
        );
        let err = due(&[
            ("x-delay", AMQPValue::LongInt(5)),
            ("x-deliver-at", AMQPValue::LongInt(5)),
        ])
        .expect_err("both");
        assert!(err.0.contains("both"), "{err}");
    }

    #[test]
    fn ops_ids_topics_and_bodies() {
        let delete = dp("t", &props(&[("x-redisched-op", s("delete"))]), b"");
        assert!(matches!(delete, Ok(Op::Delete { .. })));
        let replace = dp("t", &props(&[("x-redisched-op", s("replace"))]), b"");
        assert!(matches!(
            replace,
            Ok(Op::Put(PutRequest {
                mode: PutMode::Replace,
                ..
            }))
        ));
        let unknown = dp("t", &props(&[("x-redisched-op", s("upsert"))]), b"");
        assert!(unknown.expect_err("unknown").0.contains("upsert"));

        let no_id = dp("t", &BasicProperties::default(), b"");
        assert!(no_id.expect_err("no id").0.contains("message_id"));

        // Shell producers (amqp-publish) name the job in a header instead.
        let mut table = FieldTable::default();
        table.insert(headers::ID.into(), s("from-header"));
        let header_only = BasicProperties::default().with_headers(table.clone());
        match dp("t", &header_only, b"") {
            Ok(Op::Put(put)) => assert_eq!(put.id.as_str(), "from-header"),
            other => panic!("{other:?}"),
        }
        let both_differ = header_only.clone().with_message_id("other".into());
        let err = dp("t", &both_differ, b"").expect_err("differ");
        assert!(err.0.contains("differ"), "{err}");
        let both_same = header_only.with_message_id("from-header".into());
        assert!(dp("t", &both_same, b"").is_ok());
        let bad_topic = dp("a{b}", &props(&[]), b"");
        assert!(bad_topic.expect_err("braces").0.contains("topic"));
        assert!(dp("t", &props(&[]), &[0u8; 16]).is_ok(), "at the limit");
        let big = dp("t", &props(&[]), &[0u8; 17]);
        assert!(big.expect_err("too big").0.contains("17 bytes"));
    }

    /// A command decoded and resolved at [`NOW`]: its due time and stored spec.
    fn series(headers: &[(&str, AMQPValue)]) -> Result<(Due, Option<String>), Invalid> {
        let command = decode_parts("t", &props(headers), b"body", RULES)?.resolve(NOW)?;
        match command.op {
            Op::Put(put) => Ok((
                put.due,
                command.schedule.map(|spec| spec.as_str().to_owned()),
            )),
            Op::Delete { .. } => panic!("not a put"),
        }
    }

    fn refused(headers: &[(&str, AMQPValue)]) -> String {
        series(headers).expect_err("refused").0
    }

    #[test]
    fn interval_series_in_every_integer_width_and_as_text() {
        let every = |v: AMQPValue| series(&[("x-redisched-every", v)]);
        let expect = Ok((Due::Delay(60_000), Some("every:60000".to_owned())));
        assert_eq!(every(AMQPValue::LongInt(60_000)), expect);
        assert_eq!(every(AMQPValue::LongUInt(60_000)), expect);
        assert_eq!(every(AMQPValue::LongLongInt(60_000)), expect);
        assert_eq!(every(s("60000")), expect);
        assert_eq!(every(s(" 1m ")), expect);
        assert_eq!(
            every(AMQPValue::ShortUInt(1000)),
            Ok((Due::Delay(1000), Some("every:1000".to_owned())))
        );
        // A first occurrence given explicitly wins over "one interval from now".
        assert_eq!(
            series(&[
                ("x-redisched-every", AMQPValue::LongInt(5000)),
                ("x-delay", AMQPValue::LongInt(10)),
            ]),
            Ok((Due::Delay(10), Some("every:5000".to_owned())))
        );
        assert_eq!(
            series(&[
                ("x-redisched-every", AMQPValue::LongInt(5000)),
                ("x-deliver-at", AMQPValue::LongLongInt(NOW + 7)),
            ]),
            Ok((Due::At(NOW + 7), Some("every:5000".to_owned())))
        );
    }

    #[test]
    fn cron_series_first_occurrence_on_the_server_clock() {
        // NOW is Tuesday 2026-12-01T00:00:00Z.
        let hour = 3_600_000;
        assert_eq!(
            series(&[("x-redisched-cron", s("0 9 * * *"))]),
            Ok((
                Due::At(NOW + 9 * hour),
                Some("cron:0 9 * * *|UTC".to_owned())
            ))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 9 * * MON-FRI")),
                ("x-redisched-tz", s("Europe/Berlin")),
            ]),
            Ok((
                Due::At(NOW + 8 * hour),
                Some("cron:0 9 * * MON-FRI|Europe/Berlin".to_owned())
            ))
        );
        // Strictly after now without a start; at or after the start with one.
        assert_eq!(
            series(&[("x-redisched-cron", s("0 0 * * *"))]).map(|r| r.0),
            Ok(Due::At(NOW + 24 * hour))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 0 * * *")),
                ("x-delay", AMQPValue::LongInt(0)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("*/2 * * * * *")),
                ("x-delay", AMQPValue::LongInt(3_000)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW + 4_000))
        );
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 9 * * *")),
                ("x-deliver-at", AMQPValue::LongLongInt(NOW + 10 * hour)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW + 33 * hour))
        );
        // A past start means now.
        assert_eq!(
            series(&[
                ("x-redisched-cron", s("0 9 * * *")),
                ("x-deliver-at", AMQPValue::LongLongInt(1_000)),
            ])
            .map(|r| r.0),
            Ok(Due::At(NOW + 9 * hour))
        );
    }

    #[test]
    fn bad_schedules_are_refused_with_a_reason() {
        let err = refused(&[
            ("x-redisched-every", AMQPValue::LongInt(5000)),
            ("x-redisched-cron", s("* * * * *")),
        ]);
        assert!(
            err.contains("both x-redisched-every and x-redisched-cron"),
            "{err}"
        );
        let err = refused(&[("x-redisched-tz", s("Europe/Berlin"))]);
        assert!(
            err.contains("x-redisched-tz is only used with x-redisched-cron"),
            "{err}"
        );
        let err = refused(&[
            ("x-redisched-every", AMQPValue::LongInt(5000)),
            ("x-redisched-tz", s("UTC")),
        ]);
        assert!(err.contains("only used with"), "{err}");
        let err = refused(&[("x-redisched-cron", s("0 25 * * *"))]);
        assert!(
            err.starts_with("x-redisched-cron:") && err.contains("invalid"),
            "{err}"
        );
        let err = refused(&[("x-redisched-cron", s("0 9 * *"))]);
        assert!(err.contains("expected 5"), "{err}");
        let err = refused(&[
            ("x-redisched-cron", s("0 9 * * *")),
            ("x-redisched-tz", s("Europe/Atlantis")),
        ]);
        assert!(
            err.contains("unknown time zone \"Europe/Atlantis\""),
            "{err}"
        );
        let err = refused(&[("x-redisched-cron", s("0 0 30 2 *"))]);
        assert!(err.contains("never fires"), "{err}");
        let err = refused(&[("x-redisched-every", AMQPValue::LongInt(999))]);
        assert!(err.contains("below the minimum of 1000 ms"), "{err}");
        let err = refused(&[("x-redisched-every", s("0"))]);
        assert!(err.contains("positive"), "{err}");
        let err = refused(&[("x-redisched-every", AMQPValue::LongInt(-5))]);
        assert!(err.contains("positive"), "{err}");
        let err = refused(&[("x-redisched-every", s("often"))]);
        assert!(
            err.contains("x-redisched-every") && err.contains("often"),
            "{err}"
        );
        let err = refused(&[("x-redisched-every", AMQPValue::Double(1500.0))]);
        assert!(err.contains("integer number of milliseconds"), "{err}");
        let err = refused(&[("x-redisched-cron", AMQPValue::LongInt(5))]);
        assert!(err.contains("text cron expression"), "{err}");
        let err = refused(&[
            ("x-redisched-cron", s("* * * * *")),
            ("x-redisched-tz", AMQPValue::Boolean(true)),
        ]);
        assert!(err.contains("text IANA time zone"), "{err}");
    }

    #[test]
    fn expiry_headers_are_checked_and_kept_in_the_stored_properties() {
        let put = |v: AMQPValue| dp("t", &props(&[("x-redisched-expires-after", v)]), b"");
        let Ok(Op::Put(ok)) = put(AMQPValue::LongInt(5000)) else {
            panic!("valid expiry refused");
        };
        let stored = crate::job::meta::decode_meta(&ok.meta).expect("meta");
        assert_eq!(crate::job::expiry::of_job(&stored), Ok(Some(5000)));
        assert!(put(s("0")).is_ok());
        for bad in [AMQPValue::LongInt(-5), s("later"), AMQPValue::Double(2.5)] {
            let err = put(bad).expect_err("refused").0;
            assert!(err.contains("x-redisched-expires-after"), "{err}");
        }
    }

    #[test]
    fn unknown_bridge_headers_are_refused_and_output_headers_ignored() {
        let err = refused(&[("x-redisched-evry", AMQPValue::LongInt(5000))]);
        assert!(err.contains("unknown header x-redisched-evry"), "{err}");
        let err = refused(&[("X-Redisched-Op", s("delete"))]);
        assert!(err.contains("unknown header X-Redisched-Op"), "{err}");
        let err = dp(
            "t",
            &props(&[
                ("x-redisched-op", s("delete")),
                ("x-redisched-priority", s("high")),
                ("x-redisched-ttl", s("5")),
            ]),
            b"",
        )
        .expect_err("even on a delete");
        assert!(
            err.0
                .contains("unknown headers x-redisched-priority, x-redisched-ttl"),
            "{err}"
        );
        // Headers the bridge writes itself: a fixed set-aside command or a delivered
        // job re-published as a command is accepted, and they are not stored.
        let command = decode_parts(
            "t",
            &props(&[
                ("x-redisched-error", s("old reason")),
                ("x-redisched-topic", s("t")),
                ("x-redisched-due-at", AMQPValue::LongLongInt(5)),
                ("x-redisched-attempt", AMQPValue::LongLongInt(2)),
                ("x-redisched-every", AMQPValue::LongInt(5000)),
                ("other", s("kept")),
            ]),
            b"",
            RULES,
        )
        .and_then(|d| d.resolve(NOW))
        .expect("accepted");
        let Op::Put(put) = command.op else {
            panic!("a put")
        };
        let stored = crate::job::meta::decode_meta(&put.meta).expect("meta");
        let headers = stored.headers().clone().expect("headers");
        let mut names: Vec<&str> = headers.inner().keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        // The schedule header travels with each occurrence as given.
        assert_eq!(names, ["other", "x-redisched-every"]);
    }

    #[test]
    fn replace_and_delete_with_schedules() {
        let replace = decode_parts(
            "t",
            &props(&[
                ("x-redisched-op", s("replace")),
                ("x-redisched-cron", s("*/5 * * * *")),
                ("x-redisched-tz", s("America/New_York")),
            ]),
            b"",
            RULES,
        )
        .expect("valid");
        assert!(replace.needs_now());
        let command = replace.resolve(NOW).expect("resolved");
        assert_eq!(
            command.schedule.map(|s| s.as_str().to_owned()),
            Some("cron:*/5 * * * *|America/New_York".to_owned())
        );
        assert!(matches!(
            command.op,
            Op::Put(PutRequest {
                mode: PutMode::Replace,
                due: Due::At(at),
                ..
            }) if at == NOW + 300_000
        ));
        // A delete ends a series whatever else it carries.
        let delete = decode_parts(
            "t",
            &props(&[
                ("x-redisched-op", s("delete")),
                ("x-redisched-every", AMQPValue::LongInt(1)),
            ]),
            b"",
            RULES,
        )
        .expect("valid");
        assert!(!delete.needs_now());
        assert!(matches!(delete.op(), Op::Delete { .. }));
        // A one-shot put stays one-shot.
        let plain = decode_parts("t", &props(&[]), b"", RULES)
            .expect("valid")
            .resolve(NOW)
            .expect("resolved");
        assert_eq!(plain.schedule, None);
    }
    #[test]
    fn a_series_jitter_is_checked_kept_in_meta_and_bounded_for_its_first_occurrence() {
        let resolve = |headers: &[(&str, AMQPValue)]| {
            decode_parts("t", &props(headers), b"body", RULES)
                .and_then(|decoded| decoded.resolve(NOW))
        };
        let every = resolve(&[
            ("x-redisched-every", AMQPValue::LongInt(1000)),
            ("x-redisched-jitter", AMQPValue::LongInt(500)),
        ])
        .expect("accepted");
        assert_eq!(every.jitter_ms, 500);
        let Op::Put(put) = &every.op else {
            panic!("not a put")
        };
        let stored = crate::job::meta::decode_meta(&put.meta).expect("meta");
        assert_eq!(
            crate::job::meta::jitter_of(&stored),
            500,
            "dispatch reads it there"
        );
        let text = resolve(&[
            ("x-redisched-every", AMQPValue::LongInt(1000)),
            ("x-redisched-jitter", s("250")),
        ])
        .expect("a numeric string");
        assert_eq!(text.jitter_ms, 250);
        // Cron: the first occurrence (09:00) is an hour before the next (10:00).
        let cron = resolve(&[
            ("x-redisched-cron", s("0 9,10 * * *")),
            ("x-redisched-jitter", AMQPValue::LongInt(7_200_000)),
        ])
        .expect("any jitter suits cron");
        assert_eq!(cron.jitter_ms, 3_600_000);

        let every_1s = |jitter: AMQPValue| {
            refused(&[
                ("x-redisched-every", AMQPValue::LongInt(1000)),
                ("x-redisched-jitter", jitter),
            ])
        };
        let err = every_1s(AMQPValue::LongInt(1000));
        assert!(
            err.contains("x-redisched-jitter") && err.contains("below the interval"),
            "{err}"
        );
        let err = every_1s(AMQPValue::LongInt(-5));
        assert!(
            err.contains("x-redisched-jitter") && err.contains("-5"),
            "{err}"
        );
        let err = every_1s(s("soon"));
        assert!(
            err.contains("not a number") && err.contains("soon"),
            "{err}"
        );
        let err = every_1s(AMQPValue::Double(1.5));
        assert!(err.contains("integer number of milliseconds"), "{err}");
        let err = refused(&[("x-redisched-jitter", AMQPValue::LongInt(500))]);
        assert!(err.contains("only used with"), "{err}");
    }
}

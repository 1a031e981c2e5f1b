//! Turning one AMQP delivery into a store command, or into the reason it is invalid.
//!
//! The rules are the wire contract (README, "Commands in"): routing key = topic,
//! `message_id` = job id, `x-redisched-op` = put | replace | delete, `x-delay` (ms) or
//! `x-deliver-at` (epoch ms) for the due time, body stored verbatim.

use lapin::message::Delivery;
use lapin::types::AMQPValue;
use lapin::BasicProperties;

use crate::amqp::{encode_meta, forwardable, headers, job_id, with_plugin_delay};
use crate::job::float_millis;
use crate::job::{Due, JobId, PutMode, Topic};
use crate::store::{Limits, Op, PutRequest};

/// Why a command cannot be applied; becomes the `x-redisched-error` header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid(reason: impl Into<String>) -> Invalid {
    Invalid(reason.into())
}

/// The op a command asks for, as named in `x-redisched-op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpName {
    Put,
    Replace,
    Delete,
}

pub fn decode(delivery: &Delivery, limits: Limits) -> Result<Op, Invalid> {
    decode_parts(
        delivery.routing_key.as_str(),
        &delivery.properties,
        &delivery.data,
        limits,
    )
}

pub fn decode_parts(
    routing_key: &str,
    props: &BasicProperties,
    body: &[u8],
    limits: Limits,
) -> Result<Op, Invalid> {
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
    let table = props.headers().as_ref();
    let header = |name: &str| table.and_then(|t| t.inner().get(name));

    let op = match header(headers::OP) {
        None => OpName::Put,
        Some(value) => match text(value).as_deref() {
            Some("put") => OpName::Put,
            Some("replace") => OpName::Replace,
            Some("delete") => OpName::Delete,
            _ => {
                return Err(invalid(format!(
                    "unknown {}: {} (expected put, replace or delete)",
                    headers::OP,
                    show(value)
                )))
            }
        },
    };
    if op == OpName::Delete {
        return Ok(Op::Delete { topic, id });
    }

    let due = match (header(headers::DELAY), header(headers::DELIVER_AT)) {
        (Some(_), Some(_)) => {
            return Err(invalid(format!(
                "both {} and {} are set; give one",
                headers::DELAY,
                headers::DELIVER_AT
            )))
        }
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
            due
        }
        (None, Some(at)) => {
            let (ms, given) = millis(at, headers::DELIVER_AT)?;
            Due::at(headers::DELIVER_AT, &given, ms).map_err(|e| invalid(e.to_string()))?
        }
        (None, None) => Due::NOW,
    };
    if body.len() > limits.max_body_bytes {
        return Err(invalid(format!(
            "body is {} bytes, the limit is {}",
            body.len(),
            limits.max_body_bytes
        )));
    }
    let delivered = match due {
        // As the delayed-message plugin does: consumers written for it read x-delay.
        Due::Delay(ms) if header(headers::DELAY).is_some() => {
            with_plugin_delay(forwardable(props), ms)
        }
        _ => forwardable(props),
    };
    Ok(Op::Put(PutRequest {
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
    }))
}

/// The op name a delivery asks for, for metrics and replies even when it is invalid.
pub fn op_name(props: &BasicProperties) -> &'static str {
    let value = props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::OP))
        .and_then(text);
    match value.as_deref() {
        None | Some("put") => "put",
        Some("replace") => "replace",
        Some("delete") => "delete",
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
        match decode_parts("t", &props(headers), b"body", LIMITS)? {
            Op::Put(put) => Ok(put.due),
            Op::Delete { .. } => panic!("not a put"),
        }
    }

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
        let delete = decode_parts("t", &props(&[("x-redisched-op", s("delete"))]), b"", LIMITS);
        assert!(matches!(delete, Ok(Op::Delete { .. })));
        let replace = decode_parts(
            "t",
            &props(&[("x-redisched-op", s("replace"))]),
            b"",
            LIMITS,
        );
        assert!(matches!(
            replace,
            Ok(Op::Put(PutRequest {
                mode: PutMode::Replace,
                ..
            }))
        ));
        let unknown = decode_parts("t", &props(&[("x-redisched-op", s("upsert"))]), b"", LIMITS);
        assert!(unknown.expect_err("unknown").0.contains("upsert"));

        let no_id = decode_parts("t", &BasicProperties::default(), b"", LIMITS);
        assert!(no_id.expect_err("no id").0.contains("message_id"));

        // Shell producers (amqp-publish) name the job in a header instead.
        let mut table = FieldTable::default();
        table.insert(headers::ID.into(), s("from-header"));
        let header_only = BasicProperties::default().with_headers(table.clone());
        match decode_parts("t", &header_only, b"", LIMITS) {
            Ok(Op::Put(put)) => assert_eq!(put.id.as_str(), "from-header"),
            other => panic!("{other:?}"),
        }
        let both_differ = header_only.clone().with_message_id("other".into());
        let err = decode_parts("t", &both_differ, b"", LIMITS).expect_err("differ");
        assert!(err.0.contains("differ"), "{err}");
        let both_same = header_only.with_message_id("from-header".into());
        assert!(decode_parts("t", &both_same, b"", LIMITS).is_ok());
        let bad_topic = decode_parts("a{b}", &props(&[]), b"", LIMITS);
        assert!(bad_topic.expect_err("braces").0.contains("topic"));
        assert!(
            decode_parts("t", &props(&[]), &[0u8; 16], LIMITS).is_ok(),
            "at the limit"
        );
        let big = decode_parts("t", &props(&[]), &[0u8; 17], LIMITS);
        assert!(big.expect_err("too big").0.contains("17 bytes"));
    }
}

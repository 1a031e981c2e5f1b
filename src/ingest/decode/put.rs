//! A put, replace or delete (`x-redisched-op` absent, `put`, `replace` or `delete`): its
//! headers read in the wire table's order, each refused in the producer's terms: what
//! it names (topic = routing key, job id = `message_id` or `x-redisched-id`, the op;
//! an `x-redisched-*` header the bridge does not know is refused first), then for a put
//! or replace when it is due and how it repeats (`when.rs`), the body and the
//! properties stored with the job; a job's own URL checked against the targets; and
//! the store command, a cron series' first occurrence placed on the clock its batch
//! read before decoding.

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use super::value::{show, text};
use super::when::{due_of, first_due, schedule};
use super::{invalid, Invalid, Rules, PREFIX_DELETE};
use crate::job::headers;
use crate::job::meta::{encode_meta, forwardable, job_id, too_deep, with_plugin_delay};
use crate::job::schedule::Schedule;
use crate::job::{Due, JobId, PutMode, Topic};
use crate::store::{Command, Op, PutRequest};
use crate::targets::TargetConfig;

/// Decodes a put, replace or delete from its parts into the store command, once.
/// `now_ms` is the Redis server's clock as the batch read it (`None`: not read); only a
/// cron series reads it ([`super::needs_clock`] says which deliveries may).
pub fn decode_parts(
    routing_key: &str,
    props: &BasicProperties,
    body: &[u8],
    rules: Rules,
    now_ms: Option<i64>,
) -> Result<Command, Invalid> {
    asked(routing_key, props, body, rules)?.command(now_ms)
}

/// A delivery's put, replace or delete as [`decode_parts`] decodes it, and a put naming
/// its own URL (`x-redisched-url`) checked against `targets` at the door
/// (`crate::targets::check_job_url_for`).
pub(in crate::ingest) fn decode_command(
    delivery: &Delivery,
    rules: Rules,
    targets: &[TargetConfig],
    now_ms: Option<i64>,
) -> Result<Command, Invalid> {
    let props = &delivery.properties;
    let asked = asked(delivery.routing_key.as_str(), props, &delivery.data, rules)?;
    asked.check_url(targets)?;
    asked.command(now_ms)
}

/// A put, replace or delete as its headers ask it: all but where a put's first
/// occurrence falls, which [`Asked::command`] places.
struct Asked {
    /// A put's `due` is placed by [`Asked::command`].
    op: Op,
    schedule: Option<Schedule>,
    /// `x-delay` / `x-deliver-at` as given, if any.
    given: Option<Due>,
    /// `x-redisched-jitter` (ms, checked against the schedule), 0 for none.
    jitter_ms: u64,
    /// A put's `x-redisched-url`.
    url: Option<String>,
}

/// Reads a put, replace or delete from its parts, in the wire table's order.
fn asked(
    routing_key: &str,
    props: &BasicProperties,
    body: &[u8],
    rules: Rules,
) -> Result<Asked, Invalid> {
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
        return Ok(Asked {
            op: Op::Delete { topic, id },
            schedule: None,
            given: None,
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
    // A one-shot put is due as given, else now.
    let delivered = match given.unwrap_or(Due::NOW) {
        // As the delayed-message plugin does: consumers written for it read x-delay.
        // Not for a series: its later occurrences were never delayed by that much.
        Due::Delay(ms) if schedule.is_none() && header(headers::DELAY).is_some() => {
            with_plugin_delay(forwardable(props), ms)
        }
        _ => forwardable(props),
    };
    let url = header(headers::URL).map(url_of).transpose()?;
    Ok(Asked {
        op: Op::Put(PutRequest {
            topic,
            id,
            body: body.to_vec(),
            meta: encode_meta(&delivered),
            // Placed by `command`.
            due: Due::NOW,
            mode: if op == OpName::Replace {
                PutMode::Replace
            } else {
                PutMode::Keep
            },
        }),
        schedule,
        given,
        jitter_ms,
        url,
    })
}

impl Asked {
    /// A put's own URL checked at the door (`crate::targets::check_job_url_for`);
    /// deletes and puts without one pass.
    fn check_url(&self, targets: &[TargetConfig]) -> Result<(), Invalid> {
        if let (Op::Put(put), Some(url)) = (&self.op, self.url.as_deref()) {
            crate::targets::check_job_url_for(targets, put.topic.as_str(), url)
                .map_err(|reason| invalid(format!("{}: {reason}", headers::URL)))?;
        }
        Ok(())
    }

    /// The store command: a put's first occurrence placed (a cron series' on `now_ms`,
    /// the Redis server's clock: a match at or after the start asked for, so never
    /// before it), a series' first jitter bounded, its schedule as the store keeps it.
    fn command(self, now_ms: Option<i64>) -> Result<Command, Invalid> {
        let Asked {
            mut op,
            schedule,
            given,
            jitter_ms,
            url: _,
        } = self;
        if let Op::Put(put) = &mut op {
            put.due = first_due(schedule.as_ref(), given, now_ms)?;
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

/// The op a command asks for, as named in `x-redisched-op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpName {
    Put,
    Replace,
    Delete,
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

/// Refuses any `x-redisched-*` header (any case) the bridge does not know.
pub(super) fn refuse_unknown_headers(table: &FieldTable) -> Result<(), Invalid> {
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

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::BasicProperties;

    use super::super::fixtures::{dp, props, refused, s, NOW, RULES};
    use super::super::needs_clock;
    use super::decode_parts;
    use crate::job::headers;
    use crate::job::{Due, PutMode};
    use crate::store::{Op, PutRequest};

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
    fn replace_and_delete_with_schedules() {
        let replace = props(&[
            ("x-redisched-op", s("replace")),
            ("x-redisched-cron", s("*/5 * * * *")),
            ("x-redisched-tz", s("America/New_York")),
        ]);
        assert!(needs_clock(&replace));
        let command = decode_parts("t", &replace, b"", RULES, Some(NOW)).expect("valid");
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
        let delete = props(&[
            ("x-redisched-op", s("delete")),
            ("x-redisched-every", AMQPValue::LongInt(1)),
        ]);
        assert!(!needs_clock(&delete));
        let delete = decode_parts("t", &delete, b"", RULES, None).expect("valid");
        assert!(matches!(delete.op, Op::Delete { .. }));
        // A one-shot put stays one-shot.
        let plain = decode_parts("t", &props(&[]), b"", RULES, None).expect("valid");
        assert_eq!(plain.schedule, None);
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
            Some(NOW),
        )
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
}

//! What a put, replace or delete names: its topic (the routing key), its job id
//! (`message_id`, or `x-redisched-id`) and its op (`x-redisched-op`); and the one refusal
//! every command meets first, an `x-redisched-*` header the bridge does not know.

use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use super::value::{show, text};
use super::{invalid, Invalid, PREFIX_DELETE};
use crate::job::headers;
use crate::job::meta::job_id;
use crate::job::{JobId, Topic};

/// The op a command asks for, as named in `x-redisched-op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpName {
    Put,
    Replace,
    Delete,
}

/// The topic (routing key) and the job id (`message_id`, or `x-redisched-id`).
pub(super) fn topic_and_id(
    routing_key: &str,
    props: &BasicProperties,
) -> Result<(Topic, JobId), Invalid> {
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
pub(super) fn op_of(value: Option<&AMQPValue>) -> Result<OpName, Invalid> {
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
    use lapin::types::AMQPValue;

    use super::super::decode_parts;
    use super::super::fixtures::{dp, props, refused, s, NOW, RULES};
    use crate::store::Op;

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

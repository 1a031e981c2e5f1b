//! Job expiry: a job not delivered by its due time + `expires_after` ms is not delivered
//! at all; dispatch sets it aside to the expired exchange (confirmed) and only then
//! releases it. The value comes from the job's own header `x-redisched-expires-after`
//! (AMQP, or REST/CLI `expires_after`, stored in the job's meta like any header), else
//! from the topic's `[[policies]]` default `expires_after_ms`; 0 = never.
//!
//! This module is the one rule every face uses: what a valid value is, how it is stored
//! in the meta, and what the set-aside copy's reason says; and, for dispatch, whether a
//! reserved job has expired (`may_expire`, `expires_after`, `is_expired`: the reserve's
//! triage asks them of each job, so only the expired ones enter the set-aside).

use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

use crate::job::headers;
use crate::job::Topic;
use crate::policy::Policies;

pub use crate::policy::{check_expires_after as check_ms, ExpiryError, MAX_EXPIRES_AFTER_MS};

/// An expiry given as text (REST, CLI, an AMQP string header): whole milliseconds.
pub fn parse_ms(name: &str, text: &str) -> Result<u64, ExpiryError> {
    let ms = text.trim().parse::<i128>().map_err(|_| {
        ExpiryError(format!(
            "{name} must be a whole number of milliseconds after the due time (0 = never), got {text:?}"
        ))
    })?;
    check_ms(name, ms)
}

/// The header's value: an integer of any AMQP width, or a numeric string.
pub fn from_header(value: &AMQPValue) -> Result<u64, ExpiryError> {
    let name = headers::EXPIRES_AFTER;
    if let Some(ms) = crate::job::meta::integer(value) {
        return check_ms(name, i128::from(ms));
    }
    match value {
        AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
            Ok(text) => parse_ms(name, text),
            Err(_) => Err(ExpiryError(format!("{name} is not UTF-8 text"))),
        },
        AMQPValue::ShortString(s) => parse_ms(name, s.as_str()),
        other => Err(ExpiryError(format!(
            "{name} must be an integer number of milliseconds (or a numeric string), got {other:?}"
        ))),
    }
}

/// The job's own expiry from its stored properties: `None` when it names none, `Err`
/// when the stored value is unreadable (written by another client).
pub fn of_job(props: &BasicProperties) -> Result<Option<u64>, ExpiryError> {
    props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(headers::EXPIRES_AFTER))
        .map(from_header)
        .transpose()
}

/// The stored meta `meta` with the job's expiry header added (REST, CLI), as an AMQP
/// producer would have sent it; unchanged without one.
pub fn meta_with_expiry(meta: Vec<u8>, expires_after: Option<u64>) -> Vec<u8> {
    let Some(ms) = expires_after else {
        return meta;
    };
    let props = crate::job::meta::decode_meta(&meta).unwrap_or_default();
    let mut table: FieldTable = props.headers().clone().unwrap_or_default();
    table.insert(
        headers::EXPIRES_AFTER.into(),
        AMQPValue::LongLongInt(i64::try_from(ms).unwrap_or(i64::MAX)),
    );
    crate::job::meta::encode_meta(&props.with_headers(table))
}

/// Whether a job of `topic` whose stored meta is `meta` may expire at all: its topic has
/// a default, or its meta names the header. Read on the raw bytes, so the meta of a job
/// that cannot expire is never decoded for it.
pub fn may_expire(policies: &Policies, topic: &Topic, meta: &[u8]) -> bool {
    policies.expires_after_for(topic) > 0
        || meta
            .windows(headers::EXPIRES_AFTER.len())
            .any(|w| w == headers::EXPIRES_AFTER.as_bytes())
}

/// The job's expiry in ms (0 = never): its own header, else the topic's default. `Err`
/// when its stored value cannot be read (another client's): the job then counts as
/// having none, and the caller says so.
pub fn expires_after(
    policies: &Policies,
    topic: &Topic,
    props: &BasicProperties,
) -> Result<u64, ExpiryError> {
    Ok(of_job(props)?.unwrap_or_else(|| policies.expires_after_for(topic)))
}

/// Whether a job due at `due_at` with this expiry (0 = never) has expired at `now`
/// (epoch ms, the Redis server's clock): not delivered by due + expires_after.
pub fn is_expired(due_at: i64, expires_after: u64, now: i64) -> bool {
    expires_after > 0
        && now > due_at.saturating_add(i64::try_from(expires_after).unwrap_or(i64::MAX))
}

/// The `x-redisched-error` of a set-aside expired job.
pub fn reason(expires_after: u64) -> String {
    format!("expired: not delivered within {expires_after} ms after its due time")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Policy, TopicPattern};

    #[test]
    fn values_in_every_accepted_form_and_bad_ones_refused() {
        assert_eq!(from_header(&AMQPValue::LongInt(5000)), Ok(5000));
        assert_eq!(from_header(&AMQPValue::ShortUInt(0)), Ok(0));
        assert_eq!(
            from_header(&AMQPValue::LongString(" 250 ".as_bytes().to_vec().into())),
            Ok(250)
        );
        for bad in [
            AMQPValue::LongInt(-1),
            AMQPValue::LongString("soon".as_bytes().to_vec().into()),
            AMQPValue::LongString("1.5".as_bytes().to_vec().into()),
            AMQPValue::Double(5.0),
            AMQPValue::LongLongInt(i64::MAX),
        ] {
            let err = from_header(&bad).expect_err("refused");
            assert!(err.0.starts_with(headers::EXPIRES_AFTER), "{err}");
        }
        assert!(parse_ms("expires_after", "-5")
            .unwrap_err()
            .0
            .contains(">= 0"));
    }

    #[test]
    fn expiry_is_strictly_after_due_plus_expires_after() {
        assert!(!is_expired(1000, 0, i64::MAX), "0 never expires");
        assert!(!is_expired(1000, 500, 1500));
        assert!(is_expired(1000, 500, 1501));
        assert!(!is_expired(i64::MAX - 1, MAX_EXPIRES_AFTER_MS, i64::MAX));
    }

    fn with_header(value: Option<AMQPValue>) -> BasicProperties {
        let mut table = FieldTable::default();
        if let Some(value) = value {
            table.insert(headers::EXPIRES_AFTER.into(), value);
        }
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn the_jobs_own_header_wins_over_the_policy_and_zero_means_never() {
        let policies = Policies(vec![Policy {
            topics: vec![TopicPattern::new("mail.#").unwrap()],
            rate: None,
            expires_after_ms: 1_000,
        }]);
        let mail = Topic::new("mail.x").unwrap();
        let other = Topic::new("sms").unwrap();
        assert_eq!(
            expires_after(&policies, &mail, &with_header(None)),
            Ok(1_000)
        );
        let own = with_header(Some(AMQPValue::LongInt(50)));
        assert_eq!(expires_after(&policies, &mail, &own), Ok(50));
        let never = with_header(Some(AMQPValue::LongInt(0)));
        assert_eq!(expires_after(&policies, &mail, &never), Ok(0));
        assert_eq!(expires_after(&policies, &other, &with_header(None)), Ok(0));
        // A stored value another client wrote badly: the caller counts it as none.
        let bad = with_header(Some(AMQPValue::Boolean(true)));
        assert!(expires_after(&policies, &mail, &bad).is_err());
        // The shortcut: decode only where expiry may apply.
        assert!(may_expire(&policies, &mail, b""));
        assert!(!may_expire(&policies, &other, b""));
        let meta = crate::job::meta::encode_meta(&own);
        assert!(may_expire(&policies, &other, &meta));
    }

    #[test]
    fn the_meta_carries_the_header_beside_others() {
        let mut table = FieldTable::default();
        table.insert("x-tenant".into(), AMQPValue::LongInt(7));
        let meta = crate::job::meta::encode_meta(&BasicProperties::default().with_headers(table));
        let props =
            crate::job::meta::decode_meta(&meta_with_expiry(meta.clone(), Some(700))).unwrap();
        assert_eq!(of_job(&props), Ok(Some(700)));
        let kept = props
            .headers()
            .as_ref()
            .and_then(|t| t.inner().get("x-tenant"));
        assert_eq!(kept, Some(&AMQPValue::LongInt(7)));
        assert_eq!(meta_with_expiry(meta.clone(), None), meta);
        assert_eq!(of_job(&BasicProperties::default()), Ok(None));
    }
}

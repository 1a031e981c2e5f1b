//! A job's vocabulary, in one place: what every stage and face says about a job.
//!
//! Here: validated topics and ids ([`Topic`], [`JobId`], [`IdPrefix`] for cancel by
//! prefix), due times ([`Due`], its one range-checked constructor every face uses) and
//! [`PutMode`]. Beside it: `headers.rs` the header names of the wire contract;
//! `meta.rs` what of a command's properties is stored with its job and how (the AMQP
//! 0-9-1 encoding), and the job's own URL and jitter read back from it; `schedule.rs`
//! a series' schedule (`every`, `cron` + `tz`, jitter) and when occurrences fall;
//! `spec.rs` the spec string a series is stored with; `expiry.rs` when a job has
//! expired; `url.rs` the rule for a job's own URL (normalised prefix match, the
//! address rule); `window.rs` past times as operators write them (epoch ms or RFC 3339)
//! and the failure window of a re-drive by target; `trace.rs` the W3C trace context a job
//! carries (`traceparent`, `tracestate`).
//!
//! Topics become part of Redis key names (inside a Cluster hash tag) and AMQP routing
//! keys, so they are restricted to a safe alphabet; ids are only ever hash fields and
//! sorted-set members, so they may hold any printable text.

pub mod expiry;
pub mod headers;
pub mod meta;
pub mod schedule;
pub mod spec;
pub mod trace;
pub mod url;
pub mod window;

use std::fmt;

use serde::Serialize;

/// Longest topic name accepted, in bytes.
pub const MAX_TOPIC_LEN: usize = 200;
/// Longest job id accepted, in bytes (also enforced by `lua/put.lua`).
pub const MAX_ID_LEN: usize = 256;

/// Why a topic or job id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("{what} must not be empty")]
    Empty { what: &'static str },
    #[error("{what} is {len} bytes long, the limit is {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{what} has a forbidden character {ch:?} at byte {at} ({allowed})")]
    Forbidden {
        what: &'static str,
        ch: char,
        at: usize,
        allowed: &'static str,
    },
}

/// A topic: the AMQP routing key of its jobs and the Redis hash tag of its keys.
///
/// Allowed: ASCII letters, digits and `- _ . : /`, 1 to 200 bytes. Braces are refused
/// rather than encoded, so the hash tag `{topic}` can never be broken and key names
/// stay readable in `redis-cli`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Topic(String);

impl Topic {
    pub const ALLOWED: &'static str = "ASCII letters, digits and - _ . : / are allowed";

    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        check_len("topic", name.len(), MAX_TOPIC_LEN)?;
        if let Some((at, ch)) = name
            .char_indices()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || "-_.:/".contains(c)))
        {
            return Err(NameError::Forbidden {
                what: "topic",
                ch,
                at,
                allowed: Self::ALLOWED,
            });
        }
        Ok(Self(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A job id chosen by the producer, unique within its topic.
///
/// Any text of 1 to 256 bytes without control characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct JobId(String);

impl JobId {
    pub const ALLOWED: &'static str = "control characters are not allowed";

    pub fn new(id: impl Into<String>) -> Result<Self, NameError> {
        let id = id.into();
        check_len("job id", id.len(), MAX_ID_LEN)?;
        if let Some((at, ch)) = id.char_indices().find(|&(_, c)| c.is_control()) {
            return Err(NameError::Forbidden {
                what: "job id",
                ch,
                at,
                allowed: Self::ALLOWED,
            });
        }
        Ok(Self(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn check_len(what: &'static str, len: usize, max: usize) -> Result<(), NameError> {
    if len == 0 {
        return Err(NameError::Empty { what });
    }
    if len > max {
        return Err(NameError::TooLong { what, len, max });
    }
    Ok(())
}

/// The start of job ids, for cancelling every job it names (`delete --id-prefix`, the
/// `delete-prefix` op). The characters of a [`JobId`], 1 to 256 bytes, and at least
/// [`MIN_PREFIX_CHARS`] characters unless forced: a shorter one names a large share of
/// any id space (`a`, `us`), usually by mistake.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct IdPrefix(String);

/// The least prefix length accepted without forcing it, in characters.
pub const MIN_PREFIX_CHARS: usize = 3;

/// Why an id prefix was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefixError {
    #[error(transparent)]
    Name(#[from] NameError),
    #[error(
        "id prefix {prefix:?} is {chars} character(s) long: a prefix shorter than {MIN_PREFIX_CHARS} \
         would match a large share of all ids (--force, or force=true, if that is what you mean)"
    )]
    TooShort { prefix: String, chars: usize },
}

impl IdPrefix {
    pub fn new(prefix: impl Into<String>, force: bool) -> Result<Self, PrefixError> {
        let prefix = prefix.into();
        let checked = JobId::new(prefix).map_err(|err| match err {
            NameError::Empty { .. } => NameError::Empty { what: "id prefix" },
            NameError::TooLong { len, max, .. } => NameError::TooLong {
                what: "id prefix",
                len,
                max,
            },
            NameError::Forbidden {
                ch, at, allowed, ..
            } => NameError::Forbidden {
                what: "id prefix",
                ch,
                at,
                allowed,
            },
        })?;
        let chars = checked.0.chars().count();
        if chars < MIN_PREFIX_CHARS && !force {
            return Err(PrefixError::TooShort {
                prefix: checked.0,
                chars,
            });
        }
        Ok(Self(checked.0))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! string_newtype {
    ($($ty:ty),*) => {$(
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
        impl std::str::FromStr for $ty {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }
    )*};
}
string_newtype!(Topic, JobId);

/// When a job becomes due. Relative delays are added to the *Redis server's* clock, so
/// every bridge agrees on due times whatever its own clock says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Milliseconds from the server's now; zero or negative means now.
    Delay(i64),
    /// Epoch milliseconds; a time in the past means now.
    At(i64),
}

/// Largest magnitude of a delay or an epoch time, in ms: 16 digits keep every value
/// exact in Lua's doubles and within the scripts' argument checks (about 317,000 years).
pub const MAX_TIME_MS: i64 = 9_999_999_999_999_999;

/// Why a due time was refused, in the terms the user gave it: the field (`x-delay`,
/// `delay_ms`, `--at`…) and the value as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DueError {
    #[error("{field} {given} is out of range: at most {MAX_TIME_MS} ms")]
    DelayTooLarge { field: String, given: String },
    #[error("{field} {given} is out of range: at least -{MAX_TIME_MS} ms")]
    DelayTooNegative { field: String, given: String },
    #[error("{field} {given} is before 1970-01-01T00:00:00Z; give a time from 1970 on (a past time means now)")]
    BeforeEpoch { field: String, given: String },
    #[error("{field} {given} is out of range: at most {MAX_TIME_MS} ms since 1970")]
    TooLate { field: String, given: String },
    #[error("{field} must be an RFC 3339 time (2030-01-01T09:00:00Z; no zone means UTC), got {given:?}: {detail}")]
    NotATime {
        field: String,
        given: String,
        detail: String,
    },
}

impl Due {
    pub const NOW: Due = Due::Delay(0);

    /// The one way every face turns a user's delay into a [`Due`]: `ms` from now
    /// (zero or negative means now), refused beyond [`MAX_TIME_MS`]. `field` and
    /// `given` (the value as the user wrote it) name it in the error. Wide integers
    /// take saturated floats and 20-digit strings without wrapping.
    pub fn delay(field: &str, given: impl fmt::Display, ms: i128) -> Result<Due, DueError> {
        // The field and value are spelled out only for an error (every command passes here).
        let spelled = || (field.to_string(), given.to_string());
        if ms > i128::from(MAX_TIME_MS) {
            let (field, given) = spelled();
            return Err(DueError::DelayTooLarge { field, given });
        }
        if ms < -i128::from(MAX_TIME_MS) {
            let (field, given) = spelled();
            return Err(DueError::DelayTooNegative { field, given });
        }
        Ok(Due::Delay(ms.max(0) as i64))
    }

    /// A due time in epoch ms (a past time means now), refused before 1970 and beyond
    /// [`MAX_TIME_MS`].
    pub fn at(field: &str, given: impl fmt::Display, epoch_ms: i128) -> Result<Due, DueError> {
        let spelled = || (field.to_string(), given.to_string());
        if epoch_ms < 0 {
            let (field, given) = spelled();
            return Err(DueError::BeforeEpoch { field, given });
        }
        if epoch_ms > i128::from(MAX_TIME_MS) {
            let (field, given) = spelled();
            return Err(DueError::TooLate { field, given });
        }
        Ok(Due::At(epoch_ms as i64))
    }

    /// [`Due::at`] for a parsed calendar time (RFC 3339).
    pub fn at_time(
        field: &str,
        given: impl fmt::Display,
        time: std::time::SystemTime,
    ) -> Result<Due, DueError> {
        match time.duration_since(std::time::UNIX_EPOCH) {
            Ok(since) => Due::at(field, given, since.as_millis() as i128),
            Err(_) => Err(DueError::BeforeEpoch {
                field: field.to_string(),
                given: given.to_string(),
            }),
        }
    }
}

impl Due {
    /// [`Due::at`] for an RFC 3339 time as written (`2030-01-01T09:00:00Z`; no zone
    /// means UTC).
    pub fn at_rfc3339(field: &str, raw: &str) -> Result<Due, DueError> {
        match humantime::parse_rfc3339_weak(raw) {
            Ok(time) => Due::at_time(field, raw, time),
            // The parser has no years before 1970 and calls them "out of range".
            Err(_) if year_before_1970(raw) => Err(DueError::BeforeEpoch {
                field: field.to_string(),
                given: raw.to_string(),
            }),
            Err(err) => Err(DueError::NotATime {
                field: field.to_string(),
                given: raw.to_string(),
                detail: err.to_string(),
            }),
        }
    }
}

fn year_before_1970(raw: &str) -> bool {
    let bytes = raw.as_bytes();
    bytes.len() > 4 && bytes[4] == b'-' && raw[..4].parse::<u32>().is_ok_and(|year| year < 1970)
}

/// Milliseconds of a float (rounded up: a job is never due early), saturating; `None`
/// for NaN and infinities. Saturated values are refused by [`Due::delay`] / [`Due::at`].
pub fn float_millis(ms: f64) -> Option<i128> {
    ms.is_finite().then(|| ms.ceil() as i128)
}

/// What to do when a job with the same id already exists in the topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PutMode {
    /// Keep the existing job untouched and report a duplicate.
    #[default]
    Keep,
    /// Overwrite body, metadata and due time; a reserved job is rescheduled.
    Replace,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_refuse_braces_and_spaces_but_allow_separators() {
        assert!(Topic::new("emails.welcome:v2/eu-west_1").is_ok());
        for bad in ["a{b", "a}b", "a b", "", "é"] {
            assert!(Topic::new(bad).is_err(), "{bad:?} should be refused");
        }
        assert_eq!(
            Topic::new("x".repeat(201)),
            Err(NameError::TooLong {
                what: "topic",
                len: 201,
                max: 200
            })
        );
    }

    #[test]
    fn due_times_are_range_checked_in_the_users_terms() {
        assert_eq!(Due::delay("x-delay", "-5", -5), Ok(Due::NOW));
        assert_eq!(Due::delay("x-delay", "1500", 1500), Ok(Due::Delay(1500)));
        let huge = float_millis(1e300).unwrap();
        let err = Due::delay("x-delay", "1e300", huge).unwrap_err();
        assert_eq!(
            err.to_string(),
            "x-delay 1e300 is out of range: at most 9999999999999999 ms"
        );
        assert!(Due::delay("delay_ms", "1", i128::from(MAX_TIME_MS) + 1).is_err());
        assert_eq!(Due::at("at", "0", 0), Ok(Due::At(0)));
        let err = Due::at("x-deliver-at", "-1", -1).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("x-deliver-at -1 is before 1970"),
            "{err}"
        );
        let before = std::time::UNIX_EPOCH - std::time::Duration::from_secs(1);
        assert!(matches!(
            Due::at_time("--at", "1969-12-31T23:59:59Z", before),
            Err(DueError::BeforeEpoch { .. })
        ));
        assert!(Due::at("at", "x", i128::from(MAX_TIME_MS) + 1).is_err());
        assert_eq!(float_millis(f64::NAN), None);
        assert_eq!(float_millis(1.2), Some(2));
    }

    #[test]
    fn ids_allow_any_printable_text_up_to_the_limit() {
        assert!(JobId::new("need_some_help_email_{42}:é").is_ok());
        assert!(JobId::new("x".repeat(256)).is_ok());
        assert!(JobId::new("x".repeat(257)).is_err());
        assert!(JobId::new("a\nb").is_err());
        assert!(JobId::new("").is_err());
    }
}

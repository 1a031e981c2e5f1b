//! The vocabulary every stage shares: validated topics and ids, due times, jobs.
//!
//! Topics become part of Redis key names (inside a Cluster hash tag) and AMQP routing
//! keys, so they are restricted to a safe alphabet; ids are only ever hash fields and
//! sorted-set members, so they may hold any printable text.

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

impl Due {
    pub const NOW: Due = Due::Delay(0);
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
    fn ids_allow_any_printable_text_up_to_the_limit() {
        assert!(JobId::new("need_some_help_email_{42}:é").is_ok());
        assert!(JobId::new("x".repeat(256)).is_ok());
        assert!(JobId::new("x".repeat(257)).is_err());
        assert!(JobId::new("a\nb").is_err());
        assert!(JobId::new("").is_err());
    }
}

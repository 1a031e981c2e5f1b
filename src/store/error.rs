//! The store's error boundary: every Redis failure becomes either "try again later"
//! or "this request is refused", because callers must treat the two oppositely (a
//! command that hit an outage is kept and retried; a refused one is set aside).

use redis::{ErrorKind, RedisError, ServerErrorKind};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis could not be reached or answered with a transient error (connection lost,
    /// loading, out of memory, failover…). Nothing was refused; retrying is safe.
    #[error("redis unavailable: {0}")]
    Unavailable(#[source] RedisError),
    /// Redis refused the request itself; retrying the same request will not help.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// The request was applied, but fewer replicas than `redis.wait_replicas` confirmed
    /// it within `redis.wait_timeout_ms`: a failover now could lose it. Retrying is safe
    /// (applying again leaves the same state).
    #[error("applied, but only {confirmed} of {wanted} replicas confirmed it within {timeout_ms} ms (redis.wait_replicas); a Redis failover now could lose it: retry")]
    NotReplicated {
        wanted: u32,
        confirmed: u32,
        timeout_ms: u64,
    },
    /// A script answered in a shape this version does not understand.
    #[error("unexpected reply from {script}.lua: {detail}")]
    BadReply {
        script: &'static str,
        detail: String,
    },
}

impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }

    pub(crate) fn bad_reply(script: &'static str, detail: impl Into<String>) -> Self {
        StoreError::BadReply {
            script,
            detail: detail.into(),
        }
    }
}

/// Why Redis refused a request, with the error code the scripts use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Rejection {
    pub code: RejectCode,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RejectCode {
    BodyTooLarge,
    DelayTooLong,
    InvalidArgument,
    CorruptRecord,
    /// A key of the topic holds the wrong Redis type (damaged or foreign data).
    WrongType,
    /// An ingest write from a superseded session: a newer one wrote the topic since.
    Fenced,
    /// A script failed in a way it did not plan for.
    ScriptError,
}

impl RejectCode {
    pub fn as_str(&self) -> &'static str {
        match self {
            RejectCode::BodyTooLarge => "body_too_large",
            RejectCode::DelayTooLong => "delay_too_long",
            RejectCode::InvalidArgument => "invalid_argument",
            RejectCode::CorruptRecord => "corrupt_record",
            RejectCode::WrongType => "wrong_type",
            RejectCode::Fenced => "fenced",
            RejectCode::ScriptError => "script_error",
        }
    }
}

impl std::fmt::Display for RejectCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<RedisError> for StoreError {
    fn from(err: RedisError) -> Self {
        let code = match err.code() {
            Some("BODY_TOO_LARGE") => RejectCode::BodyTooLarge,
            Some("DELAY_TOO_LONG") => RejectCode::DelayTooLong,
            Some("INVALID_ARGUMENT") => RejectCode::InvalidArgument,
            Some("CORRUPT_RECORD") => RejectCode::CorruptRecord,
            Some("WRONGTYPE") => RejectCode::WrongType,
            Some("FENCED") => RejectCode::Fenced,
            // A Lua runtime error is a bug or damaged data, not an outage: retrying
            // would block the caller forever.
            Some("ERR") if is_script_failure(&err) => RejectCode::ScriptError,
            _ => return StoreError::Unavailable(err),
        };
        let message = err.detail().unwrap_or("").trim().to_string();
        StoreError::Rejected(Rejection { code, message })
    }
}

fn is_script_failure(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && err
            .detail()
            .is_some_and(|d| d.contains("user_script") || d.contains("script:"))
}

pub(crate) fn is_noscript(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

//! Decoding script replies. Scripts answer with nested arrays of integers and byte
//! strings; these helpers turn a wrong shape into a named error instead of a panic,
//! and read the pieces several replies share.

use redis::Value;

use super::types::LastError;
use super::StoreError;
use crate::job::Topic;

pub(crate) struct Reader {
    script: &'static str,
    items: std::vec::IntoIter<Value>,
}

impl Reader {
    pub(super) fn new(script: &'static str, value: Value) -> Result<Self, StoreError> {
        match value {
            Value::Array(items) => Ok(Self {
                script,
                items: items.into_iter(),
            }),
            other => Err(StoreError::bad_reply(
                script,
                format!("expected an array, got {other:?}"),
            )),
        }
    }

    pub(super) fn remaining(&self) -> usize {
        self.items.len()
    }

    /// The next value as it came (a field whose shape depends on the call's arguments).
    pub(super) fn next(&mut self, what: &str) -> Result<Value, StoreError> {
        self.items
            .next()
            .ok_or_else(|| StoreError::bad_reply(self.script, format!("missing {what}")))
    }

    pub(super) fn int(&mut self, what: &str) -> Result<i64, StoreError> {
        let script = self.script;
        match self.next(what)? {
            Value::Int(n) => Ok(n),
            Value::BulkString(b) => std::str::from_utf8(&b)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| StoreError::bad_reply(script, format!("{what} is not a number"))),
            other => Err(StoreError::bad_reply(
                script,
                format!("{what}: expected an integer, got {other:?}"),
            )),
        }
    }

    pub(super) fn bytes(&mut self, what: &str) -> Result<Vec<u8>, StoreError> {
        let script = self.script;
        match self.next(what)? {
            Value::BulkString(b) => Ok(b),
            Value::SimpleString(s) => Ok(s.into_bytes()),
            other => Err(StoreError::bad_reply(
                script,
                format!("{what}: expected a string, got {other:?}"),
            )),
        }
    }

    pub(super) fn string(&mut self, what: &str) -> Result<String, StoreError> {
        let bytes = self.bytes(what)?;
        String::from_utf8(bytes)
            .map_err(|_| StoreError::bad_reply(self.script, format!("{what} is not UTF-8")))
    }

    pub(super) fn array(&mut self, what: &str) -> Result<Reader, StoreError> {
        let value = self.next(what)?;
        Reader::new(self.script, value)
    }

    pub(super) fn arrays(&mut self, what: &str) -> Result<Vec<Reader>, StoreError> {
        let mut outer = self.array(what)?;
        let mut readers = Vec::with_capacity(outer.remaining());
        while outer.remaining() > 0 {
            readers.push(outer.array(what)?);
        }
        Ok(readers)
    }
}

/// `-1` in a reply means "none".
pub(crate) fn optional_time(ms: i64) -> Option<i64> {
    (ms >= 0).then_some(ms)
}

/// `''` means none in script replies.
pub(crate) fn non_empty(bytes: &[u8]) -> Option<String> {
    (!bytes.is_empty()).then(|| String::from_utf8_lossy(bytes).into_owned())
}

/// The `last_error`, `last_error_at` pair of get and list replies.
pub(crate) fn last_error(reply: &mut Reader) -> Result<Option<LastError>, StoreError> {
    let reason = String::from_utf8_lossy(&reply.bytes("last_error")?).into_owned();
    Ok(optional_time(reply.int("last_error_at")?).map(|at| LastError { reason, at }))
}

/// One topic's reply in a multi-topic call: `None` when Redis refused the call for this
/// topic (damaged data: a key of the wrong type, an unreadable record), which is logged
/// so an operator runs `redisched check`; the other topics go on. An unavailable Redis
/// is an error for the whole call.
pub(crate) fn per_topic(
    what: &str,
    topic: &Topic,
    reply: redis::RedisResult<Value>,
) -> Result<Option<Value>, StoreError> {
    match reply {
        Ok(value) => Ok(Some(value)),
        Err(err) => match (super::denials::is_denied(&err), StoreError::from(err)) {
            // The health says it once (an error), and readiness fails (`denials.rs`).
            (true, StoreError::Rejected(rejection)) => {
                tracing::debug!(%topic, %rejection, "{what}: Redis refused this topic's call for lack of permission (the Redis user's ACL); skipping it");
                Ok(None)
            }
            (false, StoreError::Rejected(rejection)) => {
                tracing::error!(%topic, %rejection, "{what}: Redis refused this topic's call; skipping it (run `redisched check {topic}`)");
                Ok(None)
            }
            (_, other) => Err(other),
        },
    }
}

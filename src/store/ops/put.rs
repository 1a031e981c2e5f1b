//! `lua/put.lua`: what a put asks for, its call (one command of a batch, `apply.rs`)
//! and what its reply says.

use redis::Value;
use serde::Serialize;

use crate::job::{Due, JobId, PutMode, Topic};
use crate::store::call::Call;
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutRequest {
    pub topic: Topic,
    pub id: JobId,
    pub body: Vec<u8>,
    /// Opaque bytes forwarded with the job; the bridge stores AMQP properties here.
    pub meta: Vec<u8>,
    pub due: Due,
    pub mode: PutMode,
}

/// How a put ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PutStatus {
    Scheduled,
    Replaced,
    Duplicate,
}

impl PutStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PutStatus::Scheduled => "scheduled",
            PutStatus::Replaced => "replaced",
            PutStatus::Duplicate => "duplicate",
        }
    }
}

/// The reply of a put: what happened and when the stored job is due (epoch ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PutOutcome {
    pub status: PutStatus,
    pub due_at: i64,
}

/// One put of a batch: the request with its schedule spec (`""`: one-shot) and the
/// first occurrence's jitter bound (0: none).
pub(super) struct Put<'a> {
    pub(super) request: &'a PutRequest,
    pub(super) spec: &'a str,
    pub(super) jitter_ms: u64,
}

impl Store {
    /// The put's call on `keys` (the topic's full or fenced key list), `epoch` being
    /// the fencing argument (`""`: unfenced).
    pub(super) fn put_call(
        &self,
        put: &Put<'_>,
        keys: &[String],
        channel: &str,
        epoch: &str,
    ) -> Call {
        let request = put.request;
        let (kind, when) = match request.due {
            Due::Delay(ms) => ("delay", ms),
            Due::At(ms) => ("at", ms),
        };
        let mode = match request.mode {
            PutMode::Keep => "nx",
            PutMode::Replace => "replace",
        };
        // The twelve arguments below (thirteen with a jitter): the variable ones as
        // they are, at most 20 digits for each number, 16 bytes for the two words.
        let numbers = if put.jitter_ms == 0 { 4 } else { 5 };
        let bytes = request.id.as_str().len()
            + request.body.len()
            + request.meta.len()
            + channel.len()
            + put.spec.len()
            + epoch.len()
            + numbers * 20
            + 16;
        let script = &self.exec.scripts().put;
        let call = Scripts::call_sized(script, &request.topic, keys, 8 + numbers, bytes)
            .arg(request.id.as_str())
            .arg(&request.body[..])
            .arg(&request.meta[..])
            .arg(mode)
            .arg(kind)
            .arg(when)
            .arg(self.limits.max_delay_ms)
            .arg(self.limits.max_body_bytes)
            .arg(channel)
            .arg(put.spec)
            .arg(self.history_max)
            .arg(epoch);
        match put.jitter_ms {
            0 => call,
            jitter => call.arg(jitter),
        }
    }
}

pub(super) fn decode(value: Value) -> Result<PutOutcome, StoreError> {
    let mut reply = Reader::new("put", value)?;
    let status = match reply.string("status")?.as_str() {
        "scheduled" => PutStatus::Scheduled,
        "replaced" => PutStatus::Replaced,
        "duplicate" => PutStatus::Duplicate,
        other => {
            return Err(StoreError::bad_reply(
                "put",
                format!("unknown status {other}"),
            ))
        }
    };
    let due_at = reply.int("due_at")?;
    Ok(PutOutcome { status, due_at })
}

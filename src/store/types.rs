//! What goes into the store and what comes back: every request and reply type of the
//! typed script API, in one place. The values they carry (`Topic`, `JobId`, `Due`,
//! `PutMode`) are the shared vocabulary of `crate::job`.

use serde::Serialize;

use crate::job::{Due, JobId, PutMode, Topic};

/// Largest batch a script accepts in one call (`limit` of reserve, pull, requeue and
/// the pairs of release).
pub const MAX_BATCH: usize = 1000;

/// Limits enforced by the put script itself, so every client gets the same refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_delay_ms: i64,
    pub max_body_bytes: usize,
}

/// A command to apply to the store, as decoded from AMQP, HTTP or the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put(PutRequest),
    Delete { topic: Topic, id: JobId },
}

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

impl Op {
    pub fn topic(&self) -> &Topic {
        match self {
            Op::Put(put) => &put.topic,
            Op::Delete { topic, .. } => topic,
        }
    }
}

/// What applying one [`Op`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Put(PutOutcome),
    Delete { removed: bool },
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

/// A job handed out by `reserve` or `pull`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedJob {
    /// Kept as the raw string Redis holds: a job put by another client is delivered
    /// even if its id would not pass [`JobId::new`].
    pub id: String,
    pub due_at: i64,
    /// 1 on the first delivery attempt.
    pub attempt: u32,
    /// Proves this reservation to `release` and `retry`; 0 for pulled jobs.
    pub token: u64,
    /// Opaque bytes forwarded with the job (the bridge stores AMQP properties here).
    pub meta: Vec<u8>,
    pub body: Vec<u8>,
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Scheduled,
    Reserved,
    /// A record in neither sorted set: an invariant violation `redisched check` repairs.
    Unindexed,
}

/// One job as `get` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    pub state: JobState,
    /// When it is due next (for a retried or requeued job, the new time).
    pub due_at: i64,
    pub attempts: u32,
    pub token: u64,
    /// When the current reservation expires; `None` unless reserved.
    pub deadline: Option<i64>,
    pub meta: Vec<u8>,
    pub body: Vec<u8>,
}

/// A topic's jobs counted by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct TopicStats {
    pub now: i64,
    pub scheduled: u64,
    pub due_now: u64,
    pub reserved: u64,
    pub expired: u64,
    pub records: u64,
}

/// The jobs one `reserve` or `pull` call took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The Redis server's clock when the script ran, epoch ms.
    pub now: i64,
    /// Due time of the topic's earliest job still waiting.
    pub next_due: Option<i64>,
    pub jobs: Vec<ReservedJob>,
    /// Ids whose record was missing or unreadable; taken off the schedule.
    pub corrupt: Vec<String>,
}

/// What one `requeue` call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requeued {
    pub count: u64,
    pub next_deadline: Option<i64>,
}

/// A token-bearing reference to a reserved job, for `release`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub topic: Topic,
    pub id: String,
    pub token: u64,
}

//! The store's types that several operations share: limits, a job's state and last
//! error, the lease that proves a reservation. (A recurring job's schedule spec is the
//! job's vocabulary: `crate::job::spec`.)
//! A type only one operation takes or answers lives in that operation's file
//! (`ops/`). The values they carry (`Topic`, `JobId`, `Due`, `PutMode`) are the shared
//! vocabulary of `crate::job`.

use serde::Serialize;

use crate::job::Topic;

/// Largest batch a script accepts in one call (`limit` of reserve, pull, requeue and
/// the pairs of release).
pub const MAX_BATCH: usize = 1000;

/// Limits enforced by the put script itself, so every client gets the same refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_delay_ms: i64,
    pub max_body_bytes: usize,
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Scheduled,
    Reserved,
    /// Set aside after `max_attempts` failed publishes; waits for a redrive.
    Parked,
    /// A record in neither sorted set: an invariant violation `redisched check` repairs.
    Unindexed,
}

/// The last failed publish recorded on a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LastError {
    /// Short reason, e.g. `unroutable: NO_ROUTE`.
    pub reason: String,
    /// When it failed, epoch ms by the Redis server's clock.
    pub at: i64,
}

/// A token-bearing reference to a reserved job, for `release`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub topic: Topic,
    pub id: String,
    pub token: u64,
}

/// Default cap of each topic's history (`history.max_per_topic`).
pub const DEFAULT_HISTORY_MAX: u32 = 1000;

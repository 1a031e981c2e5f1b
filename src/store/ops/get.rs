//! `lua/get.lua`: one job by id, wherever it is.

use redis::Value;

use crate::job::{JobId, Topic};
use crate::store::reply::{last_error, non_empty, optional_time, Reader};
use crate::store::scripts::Scripts;
use crate::store::types::{JobState, LastError};
use crate::store::{Store, StoreError};

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
    /// The schedule spec of a recurring job, `None` for a one-shot job.
    pub spec: Option<String>,
    /// Failed publishes recorded (of this occurrence, for a series).
    pub failures: u32,
    pub last_error: Option<LastError>,
}

impl Store {
    /// One job by id, or `None`. See `lua/get.lua`.
    pub async fn get(&self, topic: &Topic, id: &JobId) -> Result<Option<JobInfo>, StoreError> {
        let call = Scripts::call(&self.exec.scripts().get, topic, &self.keys).arg(id.as_str());
        let value = self.exec.run_one(call).await?;
        if value == Value::Nil {
            return Ok(None);
        }
        let mut reply = Reader::new("get", value)?;
        let state = match reply.string("state")?.as_str() {
            "scheduled" => JobState::Scheduled,
            "reserved" => JobState::Reserved,
            "parked" => JobState::Parked,
            "unindexed" => JobState::Unindexed,
            other => {
                return Err(StoreError::bad_reply(
                    "get",
                    format!("unknown state {other}"),
                ))
            }
        };
        Ok(Some(JobInfo {
            state,
            due_at: reply.int("due_at")?,
            attempts: u32::try_from(reply.int("attempts")?).unwrap_or(u32::MAX),
            token: u64::try_from(reply.int("token")?).unwrap_or(0),
            deadline: optional_time(reply.int("deadline")?),
            meta: reply.bytes("meta")?,
            body: reply.bytes("body")?,
            spec: non_empty(&reply.bytes("spec")?),
            failures: u32::try_from(reply.int("failures")?).unwrap_or(u32::MAX),
            last_error: last_error(&mut reply)?,
        }))
    }
}

//! `lua/list.lua`: a topic's waiting jobs earliest first (ids and due times), or with
//! `detail` its waiting or parked jobs with their schedule and failures.

use serde::Serialize;

use crate::job::Topic;
use crate::store::reply::{last_error, non_empty, Reader};
use crate::store::scripts::Scripts;
use crate::store::types::{JobState, LastError, MAX_BATCH};
use crate::store::{Store, StoreError};

/// Which jobs `Store::list_jobs` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListWhich {
    /// Waiting jobs, earliest first.
    Scheduled,
    /// Parked jobs, by id.
    Parked,
}

/// One job of `Store::list_jobs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobSummary {
    pub id: String,
    pub due_at: i64,
    pub state: JobState,
    pub attempts: u32,
    pub spec: Option<String>,
    pub failures: u32,
    pub last_error: Option<LastError>,
}

impl Store {
    /// The next scheduled jobs of a topic, earliest first: `(id, due_at)`.
    pub async fn list(
        &self,
        topic: &Topic,
        limit: usize,
        offset: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let call = Scripts::call(&self.exec.scripts().list, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(offset);
        let mut reply = Reader::new("list", self.exec.run_one(call).await?)?;
        let mut entries = Vec::with_capacity(reply.remaining() / 2);
        while reply.remaining() > 0 {
            entries.push((reply.string("id")?, reply.int("due_at")?));
        }
        Ok(entries)
    }

    /// Waiting or parked jobs with their schedule and failure details (`lua/list.lua`
    /// with `detail`). An entry whose record cannot be read is left out (and logged;
    /// `redisched check` reports it).
    pub async fn list_jobs(
        &self,
        topic: &Topic,
        which: ListWhich,
        limit: usize,
        offset: usize,
    ) -> Result<Vec<JobSummary>, StoreError> {
        let call = Scripts::call(&self.exec.scripts().list, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(offset)
            .arg(match which {
                ListWhich::Scheduled => "scheduled",
                ListWhich::Parked => "parked",
            })
            .arg("1");
        let value = self.exec.run_one(call).await?;
        let mut jobs = Vec::new();
        let mut reply = Reader::new("list", value)?;
        while reply.remaining() > 0 {
            let mut entry = reply.array("job")?;
            let id = String::from_utf8_lossy(&entry.bytes("id")?).into_owned();
            let due_at = entry.int("due_at")?;
            let state = match entry.string("state")?.as_str() {
                "scheduled" => JobState::Scheduled,
                "parked" => JobState::Parked,
                _ => {
                    tracing::warn!(%topic, %id, "list: unreadable record left out; run `redisched check {topic}`");
                    continue;
                }
            };
            jobs.push(JobSummary {
                id,
                due_at,
                state,
                attempts: u32::try_from(entry.int("attempts")?).unwrap_or(u32::MAX),
                spec: non_empty(&entry.bytes("spec")?),
                failures: u32::try_from(entry.int("failures")?).unwrap_or(u32::MAX),
                last_error: last_error(&mut entry)?,
            });
        }
        Ok(jobs)
    }
}

//! `lua/history.lua`: a topic's latest outcomes (written by put, delete, release, retry
//! and redrive, capped at `history_max`), newest first.

use serde::Serialize;

use crate::job::{JobId, Topic};
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::types::MAX_BATCH;
use crate::store::{Store, StoreError};

/// An outcome in a topic's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Outcome {
    #[serde(rename = "dispatched")]
    Dispatched,
    #[serde(rename = "deleted")]
    Deleted,
    #[serde(rename = "replaced")]
    Replaced,
    #[serde(rename = "parked")]
    Parked,
    #[serde(rename = "re-driven")]
    Redriven,
    /// Not delivered by its due time + expires-after: set aside to the expired exchange.
    #[serde(rename = "expired")]
    Expired,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::Deleted => "deleted",
            Outcome::Replaced => "replaced",
            Outcome::Parked => "parked",
            Outcome::Redriven => "re-driven",
            Outcome::Expired => "expired",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "dispatched" => Outcome::Dispatched,
            "deleted" => Outcome::Deleted,
            "replaced" => Outcome::Replaced,
            "parked" => Outcome::Parked,
            "re-driven" => Outcome::Redriven,
            "expired" => Outcome::Expired,
            _ => return None,
        })
    }
}

/// One entry of a topic's history (`lua/history.lua`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HistoryEntry {
    /// When it happened, epoch ms (Redis server clock).
    pub at: i64,
    pub outcome: Outcome,
    pub id: String,
    /// The job's attempts at that moment (of the occurrence, for a series).
    pub attempts: u32,
    /// The (occurrence's) due time; for `replaced` the new one.
    pub due_at: i64,
    /// The next due time for a dispatched occurrence of a series, the error for
    /// `parked`, else empty.
    pub detail: String,
}

impl Store {
    /// A topic's latest outcomes, newest first, optionally of one job. See
    /// `lua/history.lua`.
    pub async fn history(
        &self,
        topic: &Topic,
        id: Option<&JobId>,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        let call = Scripts::call(&self.exec.scripts().history, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(id.map_or("", JobId::as_str));
        let value = self.exec.run_one(call).await?;
        let mut entries = Vec::new();
        let mut reply = Reader::new("history", value)?;
        while reply.remaining() > 0 {
            let mut entry = reply.array("entry")?;
            let at = entry.int("at")?;
            let name = entry.string("outcome")?;
            let outcome = Outcome::parse(&name)
                .ok_or_else(|| StoreError::bad_reply("history", format!("outcome {name}")))?;
            entries.push(HistoryEntry {
                at,
                outcome,
                id: String::from_utf8_lossy(&entry.bytes("id")?).into_owned(),
                attempts: u32::try_from(entry.int("attempts")?).unwrap_or(u32::MAX),
                due_at: entry.int("due_at")?,
                detail: String::from_utf8_lossy(&entry.bytes("detail")?).into_owned(),
            });
        }
        Ok(entries)
    }
}

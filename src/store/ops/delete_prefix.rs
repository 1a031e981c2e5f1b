//! Cancel by id prefix (`lua/delete_prefix.lua`): every job of a topic whose id starts
//! with a prefix, removed one bounded step at a time, so no single script call grows
//! with the topic (on a 1,000,000-job topic each step examines [`PREFIX_STEP`] hash
//! entries). No per-job index exists for it: the walk scans the topic's jobs hash.

use crate::job::{IdPrefix, Topic};
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

/// Hash entries one step examines (the script's `count`): with at most 20 removals a
/// step, it keeps each step's Redis CPU under 5 ms on a 1,000,000-job topic.
pub const PREFIX_STEP: usize = 40;

/// One step's answer: where the walk stands and what this step removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixStep {
    /// Where the next step starts.
    pub cursor: String,
    pub deleted: u64,
    /// The walk is complete.
    pub done: bool,
}

impl Store {
    /// Deletes every job of `topic` whose id starts with `prefix` (bytes); how many.
    /// Fenced by `epoch` when given (ingest), as put and delete are.
    pub async fn delete_prefix(
        &self,
        topic: &Topic,
        prefix: &IdPrefix,
        epoch: Option<u64>,
    ) -> Result<u64, StoreError> {
        let mut cursor = String::from("0");
        let mut total = 0;
        loop {
            let step = self
                .delete_prefix_step(topic, prefix, &cursor, PREFIX_STEP, epoch)
                .await?;
            total += step.deleted;
            if step.done {
                return Ok(total);
            }
            cursor = step.cursor;
        }
    }

    /// [`Store::delete_prefix`] over every known topic; the topics that had matching
    /// jobs, with how many each lost.
    pub async fn delete_prefix_everywhere(
        &self,
        prefix: &IdPrefix,
    ) -> Result<Vec<(Topic, u64)>, StoreError> {
        let mut deleted = Vec::new();
        for topic in self.topics().await? {
            let n = self.delete_prefix(&topic, prefix, None).await?;
            if n > 0 {
                deleted.push((topic, n));
            }
        }
        Ok(deleted)
    }

    /// One bounded step of the walk, from `cursor` (`"0"` to start). With
    /// `redis.wait_replicas` set, it waits for the replicas like every job write.
    pub async fn delete_prefix_step(
        &self,
        topic: &Topic,
        prefix: &IdPrefix,
        cursor: &str,
        count: usize,
        epoch: Option<u64>,
    ) -> Result<PrefixStep, StoreError> {
        let keys = match epoch {
            Some(_) => self.keys.fenced(topic),
            None => self.keys.all(topic).to_vec(),
        };
        let call = Scripts::call_with_keys(&self.exec.scripts().delete_prefix, topic, &keys)
            .arg(prefix.as_str())
            .arg(cursor)
            .arg(count.clamp(1, 10_000))
            .arg(self.history_max)
            .arg(epoch.map_or(String::new(), |e| e.to_string()));
        // With `redis.wait_replicas` set it waits for the replicas, as every job write.
        let value = match self.durability {
            None => self.exec.run_one(call).await?,
            Some(want) => self.write_waiting("delete_prefix", call, want).await?,
        };
        let mut reply = Reader::new("delete_prefix", value)?;
        let cursor = reply.string("cursor")?;
        let deleted = u64::try_from(reply.int("deleted")?)
            .map_err(|_| StoreError::bad_reply("delete_prefix", "negative count"))?;
        let done = reply.int("done")? == 1;
        Ok(PrefixStep {
            cursor,
            deleted,
            done,
        })
    }
}

//! `lua/redrive.lua`: parked jobs made due now (attempts kept), one by id or a topic's
//! in bounded steps.

use serde::Serialize;

use crate::job::{JobId, Topic};
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::types::MAX_BATCH;
use crate::store::{Store, StoreError};

/// What one [`Store::redrive_step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Redriven {
    pub moved: u64,
    /// Parked jobs left in the topic.
    pub remaining: u64,
}

impl Store {
    /// Makes one parked job due now (attempts kept); `false` if it was not parked.
    pub async fn redrive(&self, topic: &Topic, id: &JobId) -> Result<bool, StoreError> {
        let step = self.redrive_call(topic, id.as_str(), 1).await?;
        Ok(step.moved == 1)
    }

    /// Makes up to `count` parked jobs of a topic due now; call again while
    /// `remaining > 0` (or use [`Store::redrive_topic`]).
    pub async fn redrive_step(&self, topic: &Topic, count: usize) -> Result<Redriven, StoreError> {
        self.redrive_call(topic, "", count.clamp(1, MAX_BATCH))
            .await
    }

    /// Every parked job of a topic due now, [`MAX_BATCH`] per call; how many moved.
    pub async fn redrive_topic(&self, topic: &Topic) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let step = self.redrive_step(topic, MAX_BATCH).await?;
            total += step.moved;
            // `moved == 0` with jobs left cannot happen; it must not loop forever.
            if step.remaining == 0 || step.moved == 0 {
                return Ok(total);
            }
        }
    }

    async fn redrive_call(
        &self,
        topic: &Topic,
        id: &str,
        count: usize,
    ) -> Result<Redriven, StoreError> {
        let call = Scripts::call(&self.exec.scripts().redrive, topic, &self.keys)
            .arg(id)
            .arg(count)
            .arg(self.keys.notify_channel())
            .arg(self.history_max);
        let mut reply = Reader::new("redrive", self.exec.run_one(call).await?)?;
        Ok(Redriven {
            moved: count_of(&mut reply, "moved")?,
            remaining: count_of(&mut reply, "remaining")?,
        })
    }
}

fn count_of(reply: &mut Reader, what: &str) -> Result<u64, StoreError> {
    Ok(u64::try_from(reply.int(what)?).unwrap_or(0))
}

//! `lua/requeue.lua`: expired reservations of a topic (or of many, in one round trip)
//! made due again.

use redis::Value;

use crate::job::Topic;
use crate::store::call::Call;
use crate::store::reply::{optional_time, per_topic, Reader};
use crate::store::scripts::Scripts;
use crate::store::types::MAX_BATCH;
use crate::store::{Store, StoreError};

/// What one `requeue` call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requeued {
    pub count: u64,
    pub next_deadline: Option<i64>,
}

impl Store {
    /// Makes up to `limit` expired reservations of a topic due again. See `lua/requeue.lua`.
    pub async fn requeue(&self, topic: &Topic, limit: usize) -> Result<Requeued, StoreError> {
        decode_requeued(self.exec.run_one(self.requeue_call(topic, limit)).await?)
    }

    /// [`Store::requeue`] for many topics in one round trip (concurrently on a cluster).
    pub async fn requeue_many(
        &self,
        topics: &[Topic],
        limit: usize,
    ) -> Result<Vec<Requeued>, StoreError> {
        let calls: Vec<Call> = topics
            .iter()
            .map(|topic| self.requeue_call(topic, limit))
            .collect();
        let replies = self.exec.run(&calls).await?;
        topics
            .iter()
            .zip(replies)
            .map(|(topic, reply)| match per_topic("requeue", topic, reply)? {
                Some(value) => decode_requeued(value),
                // A refused topic requeues nothing (and is logged).
                None => Ok(Requeued {
                    count: 0,
                    next_deadline: None,
                }),
            })
            .collect()
    }

    fn requeue_call(&self, topic: &Topic, limit: usize) -> Call {
        Scripts::call(&self.exec.scripts().requeue, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(self.keys.notify_channel())
    }
}

fn decode_requeued(value: Value) -> Result<Requeued, StoreError> {
    let mut reply = Reader::new("requeue", value)?;
    Ok(Requeued {
        count: u64::try_from(reply.int("count")?).unwrap_or(0),
        next_deadline: optional_time(reply.int("next_deadline")?),
    })
}

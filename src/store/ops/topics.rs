//! Reads across topics, no script: the topics set (whole, or stepped with `SSCAN`) and
//! the due time of each topic's earliest scheduled job.

use crate::job::Topic;
use crate::store::call::Call;
use crate::store::reply::per_topic;
use crate::store::{Store, StoreError};

impl Store {
    /// Due time of each topic's earliest scheduled job, in one round trip.
    pub async fn next_due_times(&self, topics: &[Topic]) -> Result<Vec<Option<i64>>, StoreError> {
        let calls: Vec<Call> = topics
            .iter()
            .map(|topic| {
                let [scheduled, ..] = &self.keys.topic(topic).0;
                // Parked jobs wait at 10^17 (lua/README.md): never a head to wake for.
                let mut cmd = redis::cmd("ZRANGEBYSCORE");
                cmd.arg(scheduled)
                    .arg("-inf")
                    .arg("(100000000000000000")
                    .arg("WITHSCORES")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(1);
                Call::on_topic(topic, cmd)
            })
            .collect();
        let mut heads = Vec::with_capacity(topics.len());
        for (topic, reply) in topics.iter().zip(self.exec.run(&calls).await?) {
            // A topic whose schedule cannot be read has nothing due that can be taken.
            let Some(value) = per_topic("next_due_times", topic, reply)? else {
                heads.push(None);
                continue;
            };
            let head: Vec<(String, f64)> = redis::from_redis_value(value)
                .map_err(|e| StoreError::bad_reply("next_due_times", e.to_string()))?;
            heads.push(head.first().map(|(_, score)| *score as i64));
        }
        Ok(heads)
    }

    /// Topics that ever had a job put through this crate (or registered by hand with
    /// `SADD <prefix>:topics`). Names that are not valid topics are skipped.
    pub async fn topics(&self) -> Result<Vec<Topic>, StoreError> {
        let names: Vec<String> = self
            .exec
            .query(redis::cmd("SMEMBERS").arg(self.keys.topics()))
            .await?;
        let mut topics: Vec<Topic> = names
            .into_iter()
            .filter_map(|n| Topic::new(n).ok())
            .collect();
        topics.sort();
        Ok(topics)
    }

    /// One step of an incremental walk over the known topics (`SSCAN`): the next
    /// cursor (0 when the walk is complete) and about `count` topics.
    pub async fn scan_topics(
        &self,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<Topic>), StoreError> {
        let (next, names): (u64, Vec<String>) = self
            .exec
            .query(
                redis::cmd("SSCAN")
                    .arg(self.keys.topics())
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(count),
            )
            .await?;
        Ok((
            next,
            names
                .into_iter()
                .filter_map(|n| Topic::new(n).ok())
                .collect(),
        ))
    }
}

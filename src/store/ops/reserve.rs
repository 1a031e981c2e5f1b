//! `lua/reserve.lua` and `lua/pull.lua`: taking due jobs, under a reservation (one
//! topic, or many in one round trip) or deleted at once, and the batch they answer.

use std::time::Duration;

use redis::Value;

use crate::job::Topic;
use crate::store::call::Call;
use crate::store::reply::{non_empty, optional_time, per_topic, Reader};
use crate::store::scripts::Scripts;
use crate::store::types::MAX_BATCH;
use crate::store::{Store, StoreError};

/// A job handed out by `reserve` or `pull`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservedJob {
    /// Kept as the raw string Redis holds: a job put by another client is delivered
    /// even if its id would not pass [`JobId::new`](crate::job::JobId::new).
    pub id: String,
    pub due_at: i64,
    /// 1 on the first delivery attempt.
    pub attempt: u32,
    /// Proves this reservation to `release` and `retry`; 0 for pulled jobs.
    pub token: u64,
    /// Opaque bytes forwarded with the job (the bridge stores AMQP properties here).
    pub meta: Vec<u8>,
    pub body: Vec<u8>,
    /// The server's clock when this job was reserved (the reserve reply's `now`).
    pub reserved_at: i64,
    /// The schedule spec of a recurring job (`every:<ms>`, `cron:<expr>|<tz>`): release
    /// it with its next occurrence ([`Store::release_delivered`]). `None`: one-shot.
    pub spec: Option<String>,
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
    /// The topic is paused: nothing was taken (see `Store::pause`).
    pub paused: bool,
    /// Due jobs the topic's rate limit held back in this call.
    pub throttled: u64,
    /// When the rate limit lets the next job go (`None`: no limit applies); plan the
    /// topic for the later of this and `next_due`.
    pub next_token: Option<i64>,
}

impl Store {
    /// Takes up to `limit` due jobs under a reservation of `ttr`. See `lua/reserve.lua`.
    pub async fn reserve(
        &self,
        topic: &Topic,
        ttr: Duration,
        limit: usize,
    ) -> Result<Batch, StoreError> {
        let value = self
            .exec
            .run_one(self.reserve_call(topic, ttr, limit))
            .await?;
        decode_batch("reserve", value)
    }

    /// [`Store::reserve`] on many topics in one round trip (concurrently on a cluster):
    /// with thousands of topics of a few jobs each, one call per topic would make the
    /// round trip, not Redis, the limit.
    pub async fn reserve_many(
        &self,
        topics: &[Topic],
        ttr: Duration,
        limit: usize,
    ) -> Result<Vec<Batch>, StoreError> {
        let calls: Vec<Call> = topics
            .iter()
            .map(|topic| self.reserve_call(topic, ttr, limit))
            .collect();
        let replies = self.exec.run(&calls).await?;
        let mut batches = Vec::with_capacity(topics.len());
        let mut skipped = Vec::new();
        for (topic, reply) in topics.iter().zip(replies) {
            match per_topic("reserve", topic, reply)? {
                Some(value) => batches.push(decode_batch("reserve", value)?),
                None => {
                    skipped.push(batches.len());
                    batches.push(Batch {
                        now: 0,
                        next_due: None,
                        jobs: Vec::new(),
                        corrupt: Vec::new(),
                        paused: false,
                        throttled: 0,
                        next_token: None,
                    });
                }
            }
        }
        // A refused topic gets an empty batch (nothing due that can be taken), with the
        // clock reading of the others so callers may still observe it.
        if !skipped.is_empty() {
            let now = match batches.iter().map(|b| b.now).max() {
                Some(now) if now > 0 => now,
                _ => self.server_time().await?,
            };
            for index in skipped {
                batches[index].now = now;
            }
        }
        Ok(batches)
    }

    /// Takes up to `limit` due jobs and deletes them at once. See `lua/pull.lua`.
    pub async fn pull(&self, topic: &Topic, limit: usize) -> Result<Batch, StoreError> {
        let call = Scripts::call(&self.exec.scripts().pull, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(self.history_max);
        decode_batch("pull", self.exec.run_one(call).await?)
    }

    fn reserve_call(&self, topic: &Topic, ttr: Duration, limit: usize) -> Call {
        let ttr_ms = u64::try_from(ttr.as_millis()).unwrap_or(u64::MAX).max(1);
        let keys = self.keys.limited(topic);
        let call = Scripts::call_with_keys(&self.exec.scripts().reserve, topic, &keys)
            .arg(ttr_ms)
            .arg(limit.clamp(1, MAX_BATCH));
        match self.policies.rate_for(topic) {
            Some(rate) => call.arg("").arg(rate.rate_arg()).arg(rate.burst),
            None => call,
        }
    }
}

fn decode_batch(script: &'static str, value: Value) -> Result<Batch, StoreError> {
    let mut reply = Reader::new(script, value)?;
    let now = reply.int("now")?;
    let next_due = optional_time(reply.int("next_due")?);
    let mut jobs = Vec::new();
    let mut corrupt = Vec::new();
    for mut job in reply.arrays("jobs")? {
        // An id that is not UTF-8 can only come from a raw write (put.lua refuses it).
        // Failing the whole batch would leave every job of it reserved and redelivered
        // forever, so that one job is reported as corrupt instead.
        let id = match String::from_utf8(job.bytes("id")?) {
            Ok(id) => id,
            Err(err) => {
                corrupt.push(String::from_utf8_lossy(err.as_bytes()).into_owned());
                continue;
            }
        };
        jobs.push(ReservedJob {
            id,
            due_at: job.int("due_at")?,
            attempt: u32::try_from(job.int("attempt")?).unwrap_or(u32::MAX),
            token: u64::try_from(job.int("token")?).unwrap_or(0),
            meta: job.bytes("meta")?,
            body: job.bytes("body")?,
            reserved_at: now,
            spec: non_empty(&job.bytes("spec")?),
        });
    }
    let mut corrupt_ids = reply.array("corrupt")?;
    while corrupt_ids.remaining() > 0 {
        corrupt.push(String::from_utf8_lossy(&corrupt_ids.bytes("corrupt id")?).into_owned());
    }
    let paused = reply.int("paused")? == 1;
    // Only a reserve with the rate key answers these two.
    let (throttled, next_token) = if reply.remaining() >= 2 {
        (
            u64::try_from(reply.int("throttled")?).unwrap_or(0),
            optional_time(reply.int("next_token")?),
        )
    } else {
        (0, None)
    };
    Ok(Batch {
        now,
        next_due,
        jobs,
        corrupt,
        paused,
        throttled,
        next_token,
    })
}

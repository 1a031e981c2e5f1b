//! `lua/reserve.lua` and `lua/pull.lua`: taking due jobs, under a reservation (one
//! topic, or many in one round trip) or deleted at once, and the batch they answer.
//! [`Store::reserve_many_capped`] passes `lua/reserve.lua`'s `retry_cap` (the webhook
//! sink's lanes); the plain calls pass no cap and cost what they did.

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
    /// With a retry cap: due retries the cap left scheduled in this call.
    pub held_retries: u64,
    /// With a retry cap: due jobs the call did not look at may wait (it stopped at its
    /// limit or its scan bound). `false` with retries held: no first attempt is due.
    pub unseen: bool,
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
        self.reserve_calls(topics, calls).await
    }

    /// [`Store::reserve_many`] with a retry cap per topic (`caps[i]` for `topics[i]`):
    /// at most that many of a topic's jobs taken may be retries (attempt > 1); due
    /// retries past it stay scheduled and first attempts behind them are taken
    /// (`retry_cap` of `lua/reserve.lua`). Each batch says how many retries it held
    /// and whether due jobs went unseen.
    pub async fn reserve_many_capped(
        &self,
        topics: &[Topic],
        ttr: Duration,
        limit: usize,
        caps: &[usize],
    ) -> Result<Vec<Batch>, StoreError> {
        let calls: Vec<Call> = topics
            .iter()
            .zip(caps)
            .map(|(topic, cap)| {
                self.reserve_call(topic, ttr, limit)
                    .arg((*cap).min(MAX_BATCH))
            })
            .collect();
        self.reserve_calls(topics, calls).await
    }

    async fn reserve_calls(
        &self,
        topics: &[Topic],
        calls: Vec<Call>,
    ) -> Result<Vec<Batch>, StoreError> {
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
                        held_retries: 0,
                        unseen: false,
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
        let keys = self.keys.lists(topic);
        let call = Scripts::call_with_keys(&self.exec.scripts().reserve, topic, keys.limited())
            .arg(ttr_ms)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg("");
        let call = match self.policies.rate_for(topic) {
            Some(rate) => call.arg(rate.rate_arg()).arg(rate.burst),
            None => call.arg("").arg(""),
        };
        // One string for all the jobs: parsing seven RESP values per job was the
        // largest share of a dispatched job's instructions.
        call.arg(PACKED)
    }
}

/// `reserve.lua`'s ARGV 6: the jobs as one MessagePack string.
const PACKED: &str = "msgpack";

fn decode_batch(script: &'static str, value: Value) -> Result<Batch, StoreError> {
    let mut reply = Reader::new(script, value)?;
    let now = reply.int("now")?;
    let next_due = optional_time(reply.int("next_due")?);
    let mut jobs = Vec::new();
    let mut corrupt = Vec::new();
    let mut take = |fields: JobFields| {
        // An id that is not UTF-8 can only come from a raw write (put.lua refuses it).
        // Failing the whole batch would leave every job of it reserved and redelivered
        // forever, so that one job is reported as corrupt instead.
        match String::from_utf8(fields.id) {
            Ok(id) => jobs.push(ReservedJob {
                id,
                due_at: fields.due_at,
                attempt: u32::try_from(fields.attempt).unwrap_or(u32::MAX),
                token: u64::try_from(fields.token).unwrap_or(0),
                meta: fields.meta,
                body: fields.body,
                reserved_at: now,
                spec: non_empty(&fields.spec),
            }),
            Err(err) => corrupt.push(String::from_utf8_lossy(err.as_bytes()).into_owned()),
        }
    };
    match reply.next("jobs")? {
        Value::BulkString(packed) => {
            let mut input = packed.as_slice();
            let count =
                rmp::decode::read_array_len(&mut input).map_err(|e| packed_error(script, &e))?;
            for _ in 0..count {
                take(JobFields::unpack(script, &mut input)?);
            }
        }
        array => {
            let mut list = Reader::new(script, array)?;
            while list.remaining() > 0 {
                take(JobFields::read(&mut list.array("jobs")?)?);
            }
        }
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
    // Only a reserve with a retry cap answers these two.
    let (held_retries, unseen) = if reply.remaining() >= 2 {
        (
            u64::try_from(reply.int("held")?).unwrap_or(0),
            reply.int("unseen")? == 1,
        )
    } else {
        (0, false)
    };
    Ok(Batch {
        now,
        next_due,
        jobs,
        corrupt,
        paused,
        throttled,
        next_token,
        held_retries,
        unseen,
    })
}

/// One job of a reply as the script gives it: `{ id, due_at, attempt, token, meta,
/// body [, spec] }`, from RESP arrays or from the MessagePack string (ARGV 6).
struct JobFields {
    id: Vec<u8>,
    due_at: i64,
    attempt: i64,
    token: i64,
    meta: Vec<u8>,
    body: Vec<u8>,
    /// Empty for a one-shot job, and in the version-1 shape (no 7th field).
    spec: Vec<u8>,
}

impl JobFields {
    fn read(job: &mut Reader) -> Result<Self, StoreError> {
        Ok(Self {
            id: job.bytes("id")?,
            due_at: job.int("due_at")?,
            attempt: job.int("attempt")?,
            token: job.int("token")?,
            meta: job.bytes("meta")?,
            body: job.bytes("body")?,
            spec: if job.remaining() > 0 {
                job.bytes("spec")?
            } else {
                Vec::new()
            },
        })
    }

    fn unpack(script: &'static str, input: &mut &[u8]) -> Result<Self, StoreError> {
        let fields = rmp::decode::read_array_len(input).map_err(|e| packed_error(script, &e))?;
        if !(6..=7).contains(&fields) {
            return Err(StoreError::bad_reply(
                script,
                format!("a packed job has {fields} fields, expected 6 or 7"),
            ));
        }
        Ok(Self {
            id: packed_bytes(script, input)?,
            due_at: packed_int(script, input)?,
            attempt: packed_int(script, input)?,
            token: packed_int(script, input)?,
            meta: packed_bytes(script, input)?,
            body: packed_bytes(script, input)?,
            spec: if fields == 7 {
                packed_bytes(script, input)?
            } else {
                Vec::new()
            },
        })
    }
}

fn packed_int(script: &'static str, input: &mut &[u8]) -> Result<i64, StoreError> {
    rmp::decode::read_int(input).map_err(|e| packed_error(script, &e))
}

/// A MessagePack string (Redis's cmsgpack encodes every Lua string as one), as bytes.
fn packed_bytes(script: &'static str, input: &mut &[u8]) -> Result<Vec<u8>, StoreError> {
    let len = rmp::decode::read_str_len(input).map_err(|e| packed_error(script, &e))?;
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if input.len() < len {
        return Err(StoreError::bad_reply(
            script,
            "a packed string runs past the reply's end",
        ));
    }
    let (bytes, rest) = input.split_at(len);
    *input = rest;
    Ok(bytes.to_vec())
}

fn packed_error(script: &'static str, err: &impl std::fmt::Display) -> StoreError {
    StoreError::bad_reply(script, format!("unreadable packed jobs: {err}"))
}

//! The job store: typed calls over the Lua scripts of `lua/`.
//!
//! This is the only module that knows key names or script arguments. Everything the
//! bridge, the CLI and the HTTP API do to jobs goes through [`Store`], and through the
//! same scripts any other Redis client can call (see `lua/README.md`).

mod check;
mod conn;
mod error;
mod keys;
mod link;
mod reply;
mod scripts;

use std::sync::Arc;
use std::time::Duration;

use redis::{AsyncCommands, Value};

use crate::job::{
    Due, JobId, JobInfo, JobState, PutMode, PutOutcome, PutStatus, ReservedJob, Topic, TopicStats,
};
pub use check::{CheckReport, Problem, CHECK_STEP};
pub use conn::{cluster_seeds, Conn, CLUSTER_SCHEME};
pub use error::{RejectCode, Rejection, StoreError};
pub use keys::{KeySpace, TopicKeys};
use reply::{optional_time, Reader};
use scripts::Scripts;
pub use scripts::SOURCES as SCRIPT_SOURCES;

/// Largest batch a script accepts in one call (`limit` of reserve, pull, requeue and
/// the pairs of release).
pub const MAX_BATCH: usize = 1000;

/// Limits enforced by the put script itself, so every client gets the same refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_delay_ms: i64,
    pub max_body_bytes: usize,
}

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub url: String,
    pub prefix: String,
    pub connect_timeout: Duration,
    /// A reply slower than this fails the call (as unavailable) instead of hanging.
    pub response_timeout: Duration,
}

/// A command to apply to the store, as decoded from AMQP, HTTP or the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put(PutRequest),
    Delete { topic: Topic, id: JobId },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutRequest {
    pub topic: Topic,
    pub id: JobId,
    pub body: Vec<u8>,
    /// Opaque bytes forwarded with the job; the bridge stores AMQP properties here.
    pub meta: Vec<u8>,
    pub due: Due,
    pub mode: PutMode,
}

impl Op {
    pub fn topic(&self) -> &Topic {
        match self {
            Op::Put(put) => &put.topic,
            Op::Delete { topic, .. } => topic,
        }
    }
}

/// What applying one [`Op`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Put(PutOutcome),
    Delete { removed: bool },
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
}

/// What one `requeue` call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requeued {
    pub count: u64,
    pub next_deadline: Option<i64>,
}

/// A token-bearing reference to a reserved job, for `release`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub topic: Topic,
    pub id: String,
    pub token: u64,
}

#[derive(Clone)]
pub struct Store {
    /// Replaced when it stops answering (see `link.rs`).
    conn: link::Link<Conn>,
    keys: KeySpace,
    limits: Limits,
    scripts: Arc<Scripts>,
}

impl Store {
    /// Connects and loads the scripts. Later reconnects (and `NOSCRIPT` after a Redis
    /// restart) are handled inside; callers only see [`StoreError::Unavailable`].
    pub async fn connect(options: &ConnectOptions, limits: Limits) -> Result<Self, StoreError> {
        Self::connect_with_ca(options, None, limits).await
    }

    /// [`Store::connect`] trusting the CAs of `ca_file` (PEM) besides the system roots
    /// on a `rediss://` link (`redis.tls_ca_file`).
    pub async fn connect_with_ca(
        options: &ConnectOptions,
        ca_file: Option<&std::path::Path>,
        limits: Limits,
    ) -> Result<Self, StoreError> {
        let (url, connect_timeout, response_timeout) = (
            options.url.clone(),
            options.connect_timeout,
            options.response_timeout,
        );
        let ca_file = ca_file.map(std::path::Path::to_path_buf);
        let conn =
            link::Link::open(move || {
                let (url, ca_file) = (url.clone(), ca_file.clone());
                async move {
                    Conn::open(&url, ca_file.as_deref(), connect_timeout, response_timeout).await
                }
            })
            .await
            .map_err(StoreError::Unavailable)?;
        let store = Self {
            conn,
            keys: KeySpace::new(options.prefix.clone()),
            limits,
            scripts: Arc::new(Scripts::new()),
        };
        store.load_scripts().await?;
        Ok(store)
    }

    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// A connection for callers that need raw commands (health checks, Pub/Sub setup).
    pub fn connection(&self) -> Conn {
        self.conn.current()
    }

    /// `SCRIPT LOAD`s every script; on a cluster each load goes to every primary.
    async fn load_scripts(&self) -> Result<(), StoreError> {
        let loads = self
            .scripts
            .all()
            .iter()
            .map(|script| single_command(|pipe| pipe.load_script(script)))
            .collect();
        self.query_each(loads).await?;
        Ok(())
    }

    /// Applies commands in order, in one round trip. The outer error means nothing can
    /// be said about the batch (Redis unreachable): the caller retries all of it, which
    /// is safe because applying a command twice in order leaves the same state.
    pub async fn apply(&self, ops: &[Op]) -> Result<Vec<Result<Applied, Rejection>>, StoreError> {
        // An empty pipeline is a client error in the redis crate, which would surface as
        // `Unavailable` and make a caller retry nothing forever.
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let mut results: Vec<Option<Result<Applied, Rejection>>> = vec![None; ops.len()];
        let mut pending: Vec<usize> = (0..ops.len()).collect();
        // Twice at most: the second pass reruns what met an empty script cache.
        for pass in 0..2 {
            let replies = self.run_pipeline(ops, &pending).await?;
            let mut noscript = Vec::new();
            for (&index, reply) in pending.iter().zip(replies) {
                match reply {
                    Value::ServerError(err) => {
                        let err = redis::RedisError::from(err);
                        if error::is_noscript(&err) && pass == 0 {
                            noscript.push(index);
                            continue;
                        }
                        match StoreError::from(err) {
                            StoreError::Rejected(rejection) => {
                                results[index] = Some(Err(rejection))
                            }
                            other => return Err(other),
                        }
                    }
                    value => results[index] = Some(Ok(decode_applied(&ops[index], value)?)),
                }
            }
            if noscript.is_empty() {
                break;
            }
            self.load_scripts().await?;
            pending = noscript;
        }
        results
            .into_iter()
            .map(|r| r.ok_or_else(|| StoreError::bad_reply("put", "a command got no reply")))
            .collect()
    }

    async fn run_pipeline(&self, ops: &[Op], indices: &[usize]) -> Result<Vec<Value>, StoreError> {
        // Register topics before their first put, so a dispatcher that restarts finds
        // them; SADD of a known member is a no-op.
        let mut new_topics: Vec<&str> = Vec::new();
        for &index in indices {
            if let Op::Put(put) = &ops[index] {
                if !new_topics.contains(&put.topic.as_str()) {
                    new_topics.push(put.topic.as_str());
                }
            }
        }
        if let Conn::Single(_) = self.conn.current() {
            // One round trip for everything, in order.
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            if !new_topics.is_empty() {
                pipe.sadd(self.keys.topics(), &new_topics).ignore();
            }
            let invocations: Vec<_> = indices.iter().map(|&i| self.invocation(&ops[i])).collect();
            for invocation in &invocations {
                pipe.invoke_script(invocation);
            }
            return Ok(pipe
                .query_async::<Vec<Value>>(&mut self.conn.clone())
                .await?);
        }

        // A cluster refuses pipelines that cross slots: one pipeline per topic (each
        // keeps its commands in order, which is the order that matters: ids live in a
        // topic), all in flight at once.
        if !new_topics.is_empty() {
            let _: i64 = self
                .conn
                .clone()
                .sadd(self.keys.topics(), &new_topics)
                .await?;
        }
        let mut groups: Vec<(&Topic, Vec<usize>)> = Vec::new();
        for (position, &index) in indices.iter().enumerate() {
            let topic = ops[index].topic();
            match groups.iter_mut().find(|(t, _)| *t == topic) {
                Some((_, members)) => members.push(position),
                None => groups.push((topic, vec![position])),
            }
        }
        let replies = futures_util::future::join_all(groups.iter().map(|(_, positions)| {
            let mut conn = self.conn.clone();
            let invocations: Vec<_> = positions
                .iter()
                .map(|&p| self.invocation(&ops[indices[p]]))
                .collect();
            async move {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for invocation in &invocations {
                    pipe.invoke_script(invocation);
                }
                pipe.query_async::<Vec<Value>>(&mut conn).await
            }
        }))
        .await;
        let mut values = vec![Value::Nil; indices.len()];
        for ((_, positions), reply) in groups.iter().zip(replies) {
            for (&position, value) in positions.iter().zip(reply?) {
                values[position] = value;
            }
        }
        Ok(values)
    }

    fn invocation(&self, op: &Op) -> redis::ScriptInvocation<'_> {
        match op {
            Op::Put(put) => {
                let (kind, when) = match put.due {
                    Due::Delay(ms) => ("delay", ms),
                    Due::At(ms) => ("at", ms),
                };
                let mode = match put.mode {
                    PutMode::Keep => "nx",
                    PutMode::Replace => "replace",
                };
                let mut inv = self.scripts.put.prepare_invoke();
                inv.key(&self.keys.topic(&put.topic).0)
                    .arg(put.id.as_str())
                    .arg(&put.body[..])
                    .arg(&put.meta[..])
                    .arg(mode)
                    .arg(kind)
                    .arg(when)
                    .arg(self.limits.max_delay_ms)
                    .arg(self.limits.max_body_bytes)
                    .arg(self.keys.notify_channel());
                inv
            }
            Op::Delete { topic, id } => {
                let mut inv = self.scripts.delete.prepare_invoke();
                inv.key(&self.keys.topic(topic).0).arg(id.as_str());
                inv
            }
        }
    }

    /// Schedules one job. See `lua/put.lua`.
    pub async fn put(&self, request: PutRequest) -> Result<PutOutcome, StoreError> {
        match self.apply_one(Op::Put(request)).await? {
            Applied::Put(outcome) => Ok(outcome),
            Applied::Delete { .. } => Err(StoreError::bad_reply("put", "delete reply")),
        }
    }

    /// Cancels one job wherever it is; `true` if there was one.
    pub async fn delete(&self, topic: &Topic, id: &JobId) -> Result<bool, StoreError> {
        let op = Op::Delete {
            topic: topic.clone(),
            id: id.clone(),
        };
        match self.apply_one(op).await? {
            Applied::Delete { removed } => Ok(removed),
            Applied::Put(_) => Err(StoreError::bad_reply("delete", "put reply")),
        }
    }

    async fn apply_one(&self, op: Op) -> Result<Applied, StoreError> {
        let mut results = self.apply(std::slice::from_ref(&op)).await?;
        match results.pop() {
            Some(result) => Ok(result?),
            None => Err(StoreError::bad_reply("put", "empty reply")),
        }
    }

    /// Takes up to `limit` due jobs under a reservation of `ttr`. See `lua/reserve.lua`.
    pub async fn reserve(
        &self,
        topic: &Topic,
        ttr: Duration,
        limit: usize,
    ) -> Result<Batch, StoreError> {
        let ttr_ms = u64::try_from(ttr.as_millis()).unwrap_or(u64::MAX).max(1);
        let value: Value = self
            .scripts
            .reserve
            .key(&self.keys.topic(topic).0)
            .arg(ttr_ms)
            .arg(limit.clamp(1, MAX_BATCH))
            .invoke_async(&mut self.conn.clone())
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
        let ttr_ms = u64::try_from(ttr.as_millis()).unwrap_or(u64::MAX).max(1);
        let invocations: Vec<_> = topics
            .iter()
            .map(|topic| {
                let mut inv = self.scripts.reserve.prepare_invoke();
                inv.key(&self.keys.topic(topic).0)
                    .arg(ttr_ms)
                    .arg(limit.clamp(1, MAX_BATCH));
                inv
            })
            .collect();
        let replies = self.invoke_each(&invocations).await?;
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

    /// Runs script invocations with [`Store::query_each`], loading the scripts once if
    /// Redis lost them (a restart, a failover to a replica).
    ///
    /// Each reply stands on its own: a call that Redis refused (a topic with a key of
    /// the wrong type, say) is an `Err` in its place and the others still count, so one
    /// damaged topic cannot fail a whole group. An unreachable Redis fails the lot.
    async fn invoke_each(
        &self,
        invocations: &[redis::ScriptInvocation<'_>],
    ) -> Result<Vec<redis::RedisResult<Value>>, StoreError> {
        // An empty pipeline is a client error ("empty command"), e.g. a requeue sweep
        // before the first topic exists.
        if invocations.is_empty() {
            return Ok(Vec::new());
        }
        let commands: Vec<redis::Cmd> = invocations
            .iter()
            .map(|inv| single_command(|pipe| pipe.invoke_script(inv)))
            .collect();
        let mut replies = self.query_each_reply(commands.clone()).await?;
        let lost: Vec<usize> = (0..replies.len())
            .filter(|&i| matches!(&replies[i], Err(err) if error::is_noscript(err)))
            .collect();
        if !lost.is_empty() {
            // Only the calls that met an empty script cache run again: they did nothing.
            self.load_scripts().await?;
            let again = lost.iter().map(|&i| commands[i].clone()).collect();
            for (i, reply) in lost.into_iter().zip(self.query_each_reply(again).await?) {
                replies[i] = reply;
            }
        }
        Ok(replies)
    }

    /// [`Store::query_each`] with one result per command: a command's own error does not
    /// hide the replies of the others.
    async fn query_each_reply(
        &self,
        commands: Vec<redis::Cmd>,
    ) -> redis::RedisResult<Vec<redis::RedisResult<Value>>> {
        if let Conn::Single(_) = self.conn.current() {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for command in commands {
                pipe.add_command(command);
            }
            let values: Vec<Value> = pipe.query_async(&mut self.conn.clone()).await?;
            return Ok(values
                .into_iter()
                .map(|value| match value {
                    Value::ServerError(err) => Err(redis::RedisError::from(err)),
                    value => Ok(value),
                })
                .collect());
        }
        Ok(
            futures_util::future::join_all(commands.into_iter().map(|command| {
                let mut conn = self.conn.clone();
                async move { command.query_async::<Value>(&mut conn).await }
            }))
            .await,
        )
    }

    /// Takes up to `limit` due jobs and deletes them at once. See `lua/pull.lua`.
    pub async fn pull(&self, topic: &Topic, limit: usize) -> Result<Batch, StoreError> {
        let value: Value = self
            .scripts
            .pull
            .key(&self.keys.topic(topic).0)
            .arg(limit.clamp(1, MAX_BATCH))
            .invoke_async(&mut self.conn.clone())
            .await?;
        decode_batch("pull", value)
    }

    /// Deletes delivered jobs whose reservation is still current; returns how many.
    /// One round trip for any number of topics.
    pub async fn release(&self, leases: &[Lease]) -> Result<u64, StoreError> {
        if leases.is_empty() {
            return Ok(0);
        }
        let mut by_topic: std::collections::BTreeMap<&Topic, Vec<&Lease>> = Default::default();
        for lease in leases {
            by_topic.entry(&lease.topic).or_default().push(lease);
        }
        let mut invocations = Vec::new();
        for (topic, leases) in &by_topic {
            for chunk in leases.chunks(MAX_BATCH) {
                let mut inv = self.scripts.release.prepare_invoke();
                inv.key(&self.keys.topic(topic).0);
                for lease in chunk {
                    inv.arg(lease.id.as_str()).arg(lease.token);
                }
                invocations.push(inv);
            }
        }
        // Releasing twice is harmless (the second finds nothing), so a retry after
        // NOSCRIPT in `invoke_each` is safe.
        let mut total = 0;
        for reply in self.invoke_each(&invocations).await? {
            total += redis::from_redis_value::<u64>(reply?).unwrap_or(0);
        }
        Ok(total)
    }

    /// Runs independent single-key commands, in one round trip on a standalone Redis,
    /// or concurrently on a cluster (which refuses pipelines that cross slots). The
    /// first error, if any, is returned.
    async fn query_each(&self, commands: Vec<redis::Cmd>) -> redis::RedisResult<Vec<Value>> {
        if let Conn::Single(_) = self.conn.current() {
            let mut pipe = redis::pipe();
            for command in commands {
                pipe.add_command(command);
            }
            return pipe.query_async(&mut self.conn.clone()).await;
        }
        let replies = futures_util::future::join_all(commands.into_iter().map(|command| {
            let mut conn = self.conn.clone();
            async move { command.query_async::<Value>(&mut conn).await }
        }))
        .await;
        replies.into_iter().collect()
    }

    /// Hands a reserved job back, due again after `delay`; `false` if it was no longer
    /// ours. See `lua/retry.lua`.
    pub async fn retry(&self, lease: &Lease, delay: Duration) -> Result<bool, StoreError> {
        let moved: i64 = self
            .scripts
            .retry
            .key(&self.keys.topic(&lease.topic).0)
            .arg(lease.id.as_str())
            .arg(lease.token)
            .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(moved == 1)
    }

    /// Makes up to `limit` expired reservations of a topic due again. See `lua/requeue.lua`.
    pub async fn requeue(&self, topic: &Topic, limit: usize) -> Result<Requeued, StoreError> {
        let value: Value = self
            .scripts
            .requeue
            .key(&self.keys.topic(topic).0)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(self.keys.notify_channel())
            .invoke_async(&mut self.conn.clone())
            .await?;
        let mut reply = Reader::new("requeue", value)?;
        Ok(Requeued {
            count: u64::try_from(reply.int("count")?).unwrap_or(0),
            next_deadline: optional_time(reply.int("next_deadline")?),
        })
    }

    /// [`Store::requeue`] for many topics in one round trip (concurrently on a cluster).
    pub async fn requeue_many(
        &self,
        topics: &[Topic],
        limit: usize,
    ) -> Result<Vec<Requeued>, StoreError> {
        let invocations: Vec<_> = topics
            .iter()
            .map(|topic| {
                let mut inv = self.scripts.requeue.prepare_invoke();
                inv.key(&self.keys.topic(topic).0)
                    .arg(limit.clamp(1, MAX_BATCH))
                    .arg(self.keys.notify_channel());
                inv
            })
            .collect();
        let replies = self.invoke_each(&invocations).await?;
        topics
            .iter()
            .zip(replies)
            .map(|(topic, reply)| {
                // A refused topic requeues nothing (and is logged).
                let Some(value) = per_topic("requeue", topic, reply)? else {
                    return Ok(Requeued {
                        count: 0,
                        next_deadline: None,
                    });
                };
                let mut reply = Reader::new("requeue", value)?;
                Ok(Requeued {
                    count: u64::try_from(reply.int("count")?).unwrap_or(0),
                    next_deadline: optional_time(reply.int("next_deadline")?),
                })
            })
            .collect()
    }

    /// One job by id, or `None`. See `lua/get.lua`.
    pub async fn get(&self, topic: &Topic, id: &JobId) -> Result<Option<JobInfo>, StoreError> {
        let value: Value = self
            .scripts
            .get
            .key(&self.keys.topic(topic).0)
            .arg(id.as_str())
            .invoke_async(&mut self.conn.clone())
            .await?;
        if value == Value::Nil {
            return Ok(None);
        }
        let mut reply = Reader::new("get", value)?;
        let state = match reply.string("state")?.as_str() {
            "scheduled" => JobState::Scheduled,
            "reserved" => JobState::Reserved,
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
        }))
    }

    /// A topic's jobs counted by state. See `lua/stats.lua`.
    pub async fn stats(&self, topic: &Topic) -> Result<TopicStats, StoreError> {
        let value: Value = self
            .scripts
            .stats
            .key(&self.keys.topic(topic).0)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let mut reply = Reader::new("stats", value)?;
        let mut count = |what| reply.int(what).map(|n| u64::try_from(n).unwrap_or(0));
        Ok(TopicStats {
            now: count("now")? as i64,
            scheduled: count("scheduled")?,
            due_now: count("due_now")?,
            reserved: count("reserved")?,
            expired: count("expired")?,
            records: count("records")?,
        })
    }

    /// The next scheduled jobs of a topic, earliest first: `(id, due_at)`.
    pub async fn list(
        &self,
        topic: &Topic,
        limit: usize,
        offset: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let value: Value = self
            .scripts
            .list
            .key(&self.keys.topic(topic).0)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(offset)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let mut reply = Reader::new("list", value)?;
        let mut entries = Vec::with_capacity(reply.remaining() / 2);
        while reply.remaining() > 0 {
            entries.push((reply.string("id")?, reply.int("due_at")?));
        }
        Ok(entries)
    }

    /// Due time of each topic's earliest scheduled job, in one round trip.
    pub async fn next_due_times(&self, topics: &[Topic]) -> Result<Vec<Option<i64>>, StoreError> {
        if topics.is_empty() {
            return Ok(Vec::new());
        }
        let commands = topics
            .iter()
            .map(|topic| {
                let [scheduled, ..] = &self.keys.topic(topic).0;
                let mut cmd = redis::cmd("ZRANGE");
                cmd.arg(scheduled).arg(0).arg(0).arg("WITHSCORES");
                cmd
            })
            .collect();
        let mut heads = Vec::with_capacity(topics.len());
        for (topic, reply) in topics.iter().zip(self.query_each_reply(commands).await?) {
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
        let names: Vec<String> = self.conn.clone().smembers(self.keys.topics()).await?;
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
        let (next, names): (u64, Vec<String>) = redis::cmd("SSCAN")
            .arg(self.keys.topics())
            .arg(cursor)
            .arg("COUNT")
            .arg(count)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok((
            next,
            names
                .into_iter()
                .filter_map(|n| Topic::new(n).ok())
                .collect(),
        ))
    }

    /// Adds a topic to the known set (puts through [`Store::apply`] do it themselves).
    pub async fn register_topic(&self, topic: &Topic) -> Result<(), StoreError> {
        let _: i64 = self
            .conn
            .clone()
            .sadd(self.keys.topics(), topic.as_str())
            .await?;
        Ok(())
    }

    /// The Redis server's clock, epoch ms: the one clock every due time refers to.
    pub async fn server_time(&self) -> Result<i64, StoreError> {
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(secs * 1000 + micros / 1000)
    }

    /// `PING`, for readiness checks.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let _: String = redis::cmd("PING")
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}

/// The one command a pipeline builder adds (the redis crate builds EVALSHA and
/// SCRIPT LOAD only through pipelines or invocations).
fn single_command(add: impl FnOnce(&mut redis::Pipeline) -> &mut redis::Pipeline) -> redis::Cmd {
    let mut pipe = redis::pipe();
    add(&mut pipe);
    let cmd = pipe.cmd_iter().next().cloned();
    cmd.unwrap_or_else(|| redis::cmd("PING"))
}

/// One topic's reply in a multi-topic call: `None` when Redis refused the call for this
/// topic (damaged data: a key of the wrong type, an unreadable record), which is logged
/// so an operator runs `redisched check`; the other topics go on. An unavailable Redis
/// is an error for the whole call.
fn per_topic(
    what: &str,
    topic: &Topic,
    reply: redis::RedisResult<Value>,
) -> Result<Option<Value>, StoreError> {
    match reply {
        Ok(value) => Ok(Some(value)),
        Err(err) => match StoreError::from(err) {
            StoreError::Rejected(rejection) => {
                tracing::error!(%topic, %rejection, "{what}: Redis refused this topic's call; skipping it (run `redisched check {topic}`)");
                Ok(None)
            }
            other => Err(other),
        },
    }
}

fn decode_applied(op: &Op, value: Value) -> Result<Applied, StoreError> {
    match op {
        Op::Put(_) => {
            let mut reply = Reader::new("put", value)?;
            let status = match reply.string("status")?.as_str() {
                "scheduled" => PutStatus::Scheduled,
                "replaced" => PutStatus::Replaced,
                "duplicate" => PutStatus::Duplicate,
                other => {
                    return Err(StoreError::bad_reply(
                        "put",
                        format!("unknown status {other}"),
                    ))
                }
            };
            let due_at = reply.int("due_at")?;
            Ok(Applied::Put(PutOutcome { status, due_at }))
        }
        Op::Delete { .. } => match value {
            Value::Int(n) => Ok(Applied::Delete { removed: n == 1 }),
            other => Err(StoreError::bad_reply("delete", format!("{other:?}"))),
        },
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
        });
    }
    let mut corrupt_ids = reply.array("corrupt")?;
    while corrupt_ids.remaining() > 0 {
        corrupt.push(String::from_utf8_lossy(&corrupt_ids.bytes("corrupt id")?).into_owned());
    }
    Ok(Batch {
        now,
        next_due,
        jobs,
        corrupt,
    })
}

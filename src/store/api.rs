//! The typed script API: one method per operation of `lua/`, each building its calls
//! ([`Scripts::call`]), running them through the executor and decoding the reply.
//! The script headers define the arguments and replies; this file follows them.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use redis::Value;

use super::call::Call;
use super::durable::{judge, Replication};
use super::error::Rejection;
use super::reply::{optional_time, Reader};
use super::scripts::Scripts;
use super::types::{
    Applied, Batch, Command, Delivered, Expired, JobInfo, JobState, LastError, Lease, Noted, Op,
    PutOutcome, PutRequest, PutStatus, Releasable, Requeued, ReservedJob, ScheduleSpec,
    StoreCommand, TopicStats, MAX_BATCH,
};
use super::{Store, StoreError};
use crate::job::{Due, JobId, PutMode, Topic};

impl Store {
    /// Applies commands in order, in one round trip. The outer error means nothing can
    /// be said about the batch (Redis unreachable): the caller retries all of it, which
    /// is safe because applying a command twice in order leaves the same state.
    pub async fn apply(&self, ops: &[Op]) -> Result<Vec<Result<Applied, Rejection>>, StoreError> {
        self.apply_any(ops, None).await
    }

    /// [`Store::apply`] for [`Command`]s: puts that may carry a schedule spec.
    pub async fn apply_commands(
        &self,
        commands: &[Command],
    ) -> Result<Vec<Result<Applied, Rejection>>, StoreError> {
        self.apply_any(commands, None).await
    }

    /// [`Store::apply_commands`] fenced by an ingest epoch (from
    /// [`Store::next_ingest_epoch`]): a command is refused with
    /// [`RejectCode::Fenced`](super::RejectCode::Fenced), writing nothing, if a newer
    /// epoch has written its topic, so a request its sender gave up on (it may still
    /// be on its way to Redis) cannot land after the commands that followed it.
    pub async fn apply_fenced(
        &self,
        commands: &[Command],
        epoch: u64,
    ) -> Result<Vec<Result<Applied, Rejection>>, StoreError> {
        self.apply_any(commands, Some(epoch)).await
    }

    /// A new ingest epoch, greater than every one handed out before. With durability
    /// set, the increment waits for the replicas like any write
    /// ([`StoreError::NotReplicated`] when they fall short): a counter lost at a failover
    /// could hand the same epoch to two sessions, and fencing could not tell them apart.
    pub async fn next_ingest_epoch(&self) -> Result<u64, StoreError> {
        let mut incr = redis::cmd("INCR");
        incr.arg(self.keys.ingest_epoch());
        let Some(want) = self.durability else {
            return self.exec.query(&incr).await;
        };
        let value = self
            .write_waiting("redis", Call::global(incr), want)
            .await?;
        redis::from_redis_value(value).map_err(|e| StoreError::bad_reply("redis", e.to_string()))
    }

    /// The command partition count the deployment's ingest last switched to, 1 if it
    /// never did (one commands queue): what tells a starting bridge that the broker holds
    /// another topology's commands queues to drain before its own.
    pub async fn command_partitions(&self) -> Result<u16, StoreError> {
        let mut get = redis::cmd("GET");
        get.arg(self.keys.command_partitions());
        let value: Option<u16> = self.exec.query(&get).await?;
        Ok(value.unwrap_or(1))
    }

    /// Announces the ingest `member` for `ttl_ms` (Redis clock) and returns every member
    /// whose announcement has not expired, sorted: the bridges consuming command
    /// partitions, among which the partitions are shared out.
    pub async fn ingest_members(
        &self,
        member: &str,
        ttl_ms: u64,
    ) -> Result<Vec<String>, StoreError> {
        let now = self.server_time().await?;
        let key = self.keys.ingest_members();
        let mut add = redis::cmd("ZADD");
        add.arg(&key)
            .arg(now.saturating_add(i64::try_from(ttl_ms).unwrap_or(i64::MAX)))
            .arg(member);
        let _: Value = self.exec.query(&add).await?;
        let mut prune = redis::cmd("ZREMRANGEBYSCORE");
        prune.arg(&key).arg("-inf").arg(now);
        let _: Value = self.exec.query(&prune).await?;
        let mut range = redis::cmd("ZRANGE");
        range.arg(&key).arg(0).arg(-1);
        let mut members: Vec<String> = self.exec.query(&range).await?;
        members.sort();
        Ok(members)
    }

    /// Withdraws the ingest `member`'s announcement (on shutdown), so the others take
    /// its partitions over at once instead of when it expires.
    pub async fn leave_ingest(&self, member: &str) -> Result<(), StoreError> {
        let mut rem = redis::cmd("ZREM");
        rem.arg(self.keys.ingest_members()).arg(member);
        let _: Value = self.exec.query(&rem).await?;
        Ok(())
    }

    /// Records the partition count ingest switched to (1 deletes the record).
    pub async fn set_command_partitions(&self, partitions: u16) -> Result<(), StoreError> {
        let call = if partitions > 1 {
            let mut set = redis::cmd("SET");
            set.arg(self.keys.command_partitions()).arg(partitions);
            set
        } else {
            let mut del = redis::cmd("DEL");
            del.arg(self.keys.command_partitions());
            del
        };
        let _: Value = self.exec.query(&call).await?;
        Ok(())
    }

    /// With durability set, fails with [`StoreError::NotReplicated`] when the replicas
    /// fall short (everything was applied all the same).
    async fn apply_any<C: StoreCommand>(
        &self,
        ops: &[C],
        epoch: Option<u64>,
    ) -> Result<Vec<Result<Applied, Rejection>>, StoreError> {
        let (results, replication) = self.apply_waiting(ops, epoch).await?;
        self.demand(replication)?;
        Ok(results)
    }

    /// Applies `ops` in one round trip, fenced by `epoch` if given; with durability set,
    /// the same pipelines wait for the replicas (`durable.rs`).
    pub(super) async fn apply_waiting<C: StoreCommand>(
        &self,
        ops: &[C],
        epoch: Option<u64>,
    ) -> Result<(Vec<Result<Applied, Rejection>>, Replication), StoreError> {
        if ops.is_empty() {
            return Ok((Vec::new(), Replication::NotAsked));
        }
        let mut put_topics: Vec<&Topic> = Vec::new();
        for op in ops {
            if let Op::Put(put) = op.op() {
                if !put_topics.contains(&&put.topic) {
                    put_topics.push(&put.topic);
                }
            }
        }
        // Topics not registered lately go into the topics set before their first put
        // (global calls run first), so a dispatcher that restarts finds them.
        let loads = self.exec.script_epoch();
        let register = self.registry.unregistered(loads, &put_topics);
        let mut calls = self.op_calls(ops, epoch);
        if !register.is_empty() {
            calls.push(self.register_call(&register));
        }
        let sent = Instant::now();
        let (mut replies, replication) = match self.durability {
            None => (self.exec.run(&calls).await?, Replication::NotAsked),
            Some(want) => {
                let (replies, acks) = self.exec.run_waiting(&calls, &want).await?;
                (replies, judge(want, acks))
            }
        };
        if replies.len() > ops.len() {
            match replies.pop() {
                Some(Ok(_)) => self.registry.registered(loads, sent, &register),
                Some(Err(err)) => match StoreError::from(err) {
                    err @ StoreError::Unavailable(_) => return Err(err),
                    err => tracing::error!(error = %err, "cannot register topics"),
                },
                None => {}
            }
        }
        // The scripts were loaded again meanwhile: Redis may have come back without its
        // data, topics set included, so this batch's topics are registered again now.
        if self.exec.script_epoch() != loads && !put_topics.is_empty() {
            match self.register_now(&put_topics).await {
                Ok(()) => {}
                Err(err @ StoreError::Unavailable(_)) => return Err(err),
                Err(err) => tracing::error!(error = %err, "cannot register topics"),
            }
        }
        let results = ops
            .iter()
            .zip(replies)
            .map(|(op, reply)| match reply {
                Ok(value) => Ok(Ok(decode_applied(op.op(), value)?)),
                Err(err) => match StoreError::from(err) {
                    StoreError::Rejected(rejection) => Ok(Err(rejection)),
                    other => Err(other),
                },
            })
            .collect::<Result<_, StoreError>>()?;
        Ok((results, replication))
    }

    /// One call per command, fenced by `epoch` if given. A batch names few topics:
    /// each one's key list, and the channel name, are spelled once per batch rather
    /// than once per command.
    fn op_calls<C: StoreCommand>(&self, ops: &[C], epoch: Option<u64>) -> Vec<Call> {
        let channel = self.keys.notify_channel();
        // '' leaves the write unfenced (the scripts' optional last argument).
        let epoch_arg = epoch.map_or(String::new(), |e| e.to_string());
        let mut key_lists: HashMap<&Topic, Vec<String>> = HashMap::new();
        ops.iter()
            .map(|command| {
                let topic = command.op().topic();
                let keys = key_lists.entry(topic).or_insert_with(|| match epoch {
                    Some(_) => self.keys.fenced(topic),
                    None => self.keys.all(topic).to_vec(),
                });
                self.op_call(command, keys, &channel, &epoch_arg)
            })
            .collect()
    }

    fn op_call<C: StoreCommand>(
        &self,
        command: &C,
        keys: &[String],
        channel: &str,
        epoch: &str,
    ) -> Call {
        let scripts = self.exec.scripts();
        match command.op() {
            Op::Put(put) => {
                let (kind, when) = match put.due {
                    Due::Delay(ms) => ("delay", ms),
                    Due::At(ms) => ("at", ms),
                };
                let mode = match put.mode {
                    PutMode::Keep => "nx",
                    PutMode::Replace => "replace",
                };
                let spec = command.schedule().map_or("", ScheduleSpec::as_str);
                let jitter_ms = command.jitter_ms();
                // The twelve arguments below (thirteen with a jitter): the variable ones as
                // they are, at most 20 digits for each number, 16 bytes for the two words.
                let numbers = if jitter_ms == 0 { 4 } else { 5 };
                let bytes = put.id.as_str().len()
                    + put.body.len()
                    + put.meta.len()
                    + channel.len()
                    + spec.len()
                    + epoch.len()
                    + numbers * 20
                    + 16;
                let call = Scripts::call_sized(&scripts.put, &put.topic, keys, 8 + numbers, bytes)
                    .arg(put.id.as_str())
                    .arg(&put.body[..])
                    .arg(&put.meta[..])
                    .arg(mode)
                    .arg(kind)
                    .arg(when)
                    .arg(self.limits.max_delay_ms)
                    .arg(self.limits.max_body_bytes)
                    .arg(channel)
                    .arg(spec)
                    .arg(self.history_max)
                    .arg(epoch);
                match jitter_ms {
                    0 => call,
                    jitter => call.arg(jitter),
                }
            }
            Op::Delete { topic, id } => Scripts::call_with_keys(&scripts.delete, topic, keys)
                .arg(id.as_str())
                .arg(self.history_max)
                .arg(epoch),
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

    /// Deletes delivered jobs whose reservation is still current; returns how many.
    /// One round trip for any number of topics. Releasing twice is harmless (the second
    /// finds nothing), so the executor's rerun after `NOSCRIPT` is safe. A recurring job
    /// needs [`Store::release_delivered`]: `release.lua` refuses to end a series
    /// silently; such a refused job is logged and stays reserved (redelivered after its
    /// time-to-run), and the other jobs of the call are released one by one.
    pub async fn release(&self, leases: &[Lease]) -> Result<u64, StoreError> {
        self.release_any(leases).await
    }

    /// Releases delivered jobs whose reservation is still current: deletes one-shot
    /// jobs, and moves recurring ones to their next occurrence (or ends their series)
    /// in the same atomic step, token-fenced; returns how many.
    pub async fn release_delivered(&self, delivered: &[Delivered]) -> Result<u64, StoreError> {
        self.release_any(delivered).await
    }

    /// [`Store::release_delivered`] with a note on each `dispatched` history entry.
    pub async fn release_noted(&self, delivered: &[Noted]) -> Result<u64, StoreError> {
        self.release_any(delivered).await
    }

    /// Releases jobs set aside as expired (their copy in the expired exchange was
    /// confirmed): exactly as [`Store::release_noted`], logged `expired`.
    pub async fn release_expired(&self, expired: &[Expired]) -> Result<u64, StoreError> {
        self.release_any(expired).await
    }

    async fn release_any<R: Releasable>(&self, leases: &[R]) -> Result<u64, StoreError> {
        let mut by_topic: BTreeMap<&Topic, Vec<&R>> = BTreeMap::new();
        for item in leases {
            by_topic.entry(&item.lease().topic).or_default().push(item);
        }
        let chunks: Vec<&[&R]> = by_topic
            .values()
            .flat_map(|items| items.chunks(MAX_BATCH))
            .collect();
        let calls: Vec<Call> = chunks
            .iter()
            .map(|chunk| self.release_call(chunk))
            .collect();
        let mut total = 0;
        let mut refused: Vec<&R> = Vec::new();
        for (chunk, reply) in chunks.iter().zip(self.exec.run(&calls).await?) {
            match released(reply)? {
                Ok(count) => total += count,
                // Redis refused the call as a whole (nothing in it changed): a recurring
                // job released without its next due time, or damaged data. Retried one
                // by one below, so the one refused entry keeps no other job reserved.
                Err(_) if chunk.len() > 1 => refused.extend(chunk.iter().copied()),
                Err(rejection) => log_refused_release(chunk[0], &rejection),
            }
        }
        if !refused.is_empty() {
            let calls: Vec<Call> = refused
                .iter()
                .map(|item| self.release_call(std::slice::from_ref(item)))
                .collect();
            for (item, reply) in refused.iter().zip(self.exec.run(&calls).await?) {
                match released(reply)? {
                    Ok(count) => total += count,
                    Err(rejection) => log_refused_release(*item, &rejection),
                }
            }
        }
        Ok(total)
    }

    fn release_call<R: Releasable>(&self, items: &[&R]) -> Call {
        let topic = &items[0].lease().topic;
        let mut call = Scripts::call(&self.exec.scripts().release, topic, &self.keys);
        for item in items {
            let lease = item.lease();
            let mut arg = match item.note() {
                None => item.next_due().lease_arg(lease.token),
                Some(note) => format!(
                    "{};{}",
                    item.next_due().lease_arg(lease.token),
                    short_note(note)
                ),
            };
            if item.expired() {
                arg.insert_str(0, "expired:");
            }
            call = call.arg(lease.id.as_str()).arg(arg);
        }
        // An odd argument count: the last one is history_max.
        call.arg(self.history_max)
    }

    /// Hands a reserved job back, due again after `delay`; `false` if it was no longer
    /// ours. See `lua/retry.lua`.
    pub async fn retry(&self, lease: &Lease, delay: Duration) -> Result<bool, StoreError> {
        let topic = &lease.topic;
        let call = Scripts::call(&self.exec.scripts().retry, topic, &self.keys)
            .arg(lease.id.as_str())
            .arg(lease.token)
            .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
        let moved: i64 = redis::from_redis_value(self.exec.run_one(call).await?)
            .map_err(|e| StoreError::bad_reply("retry", e.to_string()))?;
        Ok(moved == 1)
    }

    fn requeue_call(&self, topic: &Topic, limit: usize) -> Call {
        Scripts::call(&self.exec.scripts().requeue, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(self.keys.notify_channel())
    }

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

    /// A topic's jobs counted by state. See `lua/stats.lua`.
    pub async fn stats(&self, topic: &Topic) -> Result<TopicStats, StoreError> {
        let call = Scripts::call(&self.exec.scripts().stats, topic, &self.keys);
        // The rate limit's view rides in the same round trip (same slot).
        let mut replies = self
            .exec
            .run(&[call, self.rate_get_call(topic)])
            .await?
            .into_iter();
        let (Some(stats), Some(rate)) = (replies.next(), replies.next()) else {
            return Err(StoreError::bad_reply("stats", "a call got no reply"));
        };
        let rate = super::rate::decode_rate_state(rate?)?;
        let mut reply = Reader::new("stats", stats?)?;
        let mut count = |what| reply.int(what).map(|n| u64::try_from(n).unwrap_or(0));
        Ok(TopicStats {
            now: count("now")? as i64,
            scheduled: count("scheduled")?,
            due_now: count("due_now")?,
            reserved: count("reserved")?,
            expired: count("expired")?,
            records: count("records")?,
            parked: count("parked")?,
            paused: count("paused")? == 1,
            failing: count("failing")?,
            history: count("history")?,
            throttled: rate.throttled,
            rate_limit: rate.limit,
        })
    }

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

    /// The Redis server's clock, epoch ms: the one clock every due time refers to.
    pub async fn server_time(&self) -> Result<i64, StoreError> {
        let (secs, micros): (i64, i64) = self.exec.query(&redis::cmd("TIME")).await?;
        Ok(secs * 1000 + micros / 1000)
    }

    /// `PING`, for readiness checks.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let _: String = self.exec.query(&redis::cmd("PING")).await?;
        Ok(())
    }
}

/// A release call's count, or Redis's refusal of it; an unavailable Redis is an error.
fn released(reply: redis::RedisResult<Value>) -> Result<Result<u64, Rejection>, StoreError> {
    match reply {
        Ok(value) => Ok(Ok(redis::from_redis_value::<u64>(value).unwrap_or(0))),
        Err(err) => match StoreError::from(err) {
            StoreError::Rejected(rejection) => Ok(Err(rejection)),
            other => Err(other),
        },
    }
}

/// A release note cut to what `release.lua` takes (100 bytes, on a char boundary).
fn short_note(note: &str) -> &str {
    let mut end = note.len().min(100);
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    &note[..end]
}

/// The job stays reserved, so it is delivered again after its time-to-run.
fn log_refused_release<R: Releasable>(item: &R, rejection: &Rejection) {
    let lease = item.lease();
    tracing::error!(topic = %lease.topic, id = %lease.id, %rejection, "release refused; the job stays reserved and is delivered again after its time-to-run (a recurring job needs its next due time)");
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

fn decode_requeued(value: Value) -> Result<Requeued, StoreError> {
    let mut reply = Reader::new("requeue", value)?;
    Ok(Requeued {
        count: u64::try_from(reply.int("count")?).unwrap_or(0),
        next_deadline: optional_time(reply.int("next_deadline")?),
    })
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

/// `''` means none in script replies.
pub(super) fn non_empty(bytes: &[u8]) -> Option<String> {
    (!bytes.is_empty()).then(|| String::from_utf8_lossy(bytes).into_owned())
}

/// The `last_error`, `last_error_at` pair of get and list replies.
pub(super) fn last_error(reply: &mut Reader) -> Result<Option<LastError>, StoreError> {
    let reason = String::from_utf8_lossy(&reply.bytes("last_error")?).into_owned();
    Ok(optional_time(reply.int("last_error_at")?).map(|at| LastError { reason, at }))
}

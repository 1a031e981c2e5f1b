//! The command batch: puts and deletes applied in order in one round trip, optionally
//! fenced by an ingest epoch, with the batch's new topics registered first and, with
//! durability set, the replicas waited for in the same pipelines (`durable.rs`).
//! What each command's call is, and what its reply says, is `put.rs` and `delete.rs`.

use std::collections::HashMap;
use std::time::Instant;

use redis::Value;

use super::put::{PutOutcome, PutRequest};
use super::{delete, put};
use crate::job::spec::ScheduleSpec;
use crate::job::{JobId, Topic};
use crate::store::call::Call;
use crate::store::durable::{judge, Replication};
use crate::store::error::Rejection;
use crate::store::{Store, StoreError};

/// A command to apply to the store, as decoded from AMQP, HTTP or the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put(PutRequest),
    Delete { topic: Topic, id: JobId },
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

/// An [`Op`] with the scheduler features: a put with `Some(schedule)` stores a
/// recurring job (a replace with `None` makes it one-shot again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    pub op: Op,
    pub schedule: Option<ScheduleSpec>,
    /// A jittered series: the bound its first occurrence's delay is taken modulo
    /// (`Schedule::jitter_bound` of the first due time; `put.lua` computes the delay
    /// once it has resolved that time). 0: none.
    pub jitter_ms: u64,
}

impl From<Op> for Command {
    fn from(op: Op) -> Self {
        Self {
            op,
            schedule: None,
            jitter_ms: 0,
        }
    }
}

/// What the apply path takes: a plain [`Op`], or a [`Command`].
pub(crate) trait StoreCommand {
    fn op(&self) -> &Op;
    /// The schedule a put gives its job (ignored for deletes).
    fn schedule(&self) -> Option<&ScheduleSpec> {
        None
    }
    /// The first occurrence's jitter bound (`put.lua`'s `jitter_ms`), 0 for none.
    fn jitter_ms(&self) -> u64 {
        0
    }
}

impl StoreCommand for Op {
    fn op(&self) -> &Op {
        self
    }
}

impl StoreCommand for Command {
    fn op(&self) -> &Op {
        &self.op
    }
    fn schedule(&self) -> Option<&ScheduleSpec> {
        self.schedule.as_ref()
    }
    fn jitter_ms(&self) -> u64 {
        self.jitter_ms
    }
}

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
    /// [`RejectCode::Fenced`](crate::store::RejectCode::Fenced), writing nothing, if a
    /// newer epoch has written its topic, so a request its sender gave up on (it may
    /// still be on its way to Redis) cannot land after the commands that followed it.
    pub async fn apply_fenced(
        &self,
        commands: &[Command],
        epoch: u64,
    ) -> Result<Vec<Result<Applied, Rejection>>, StoreError> {
        self.apply_any(commands, Some(epoch)).await
    }

    /// Applies `commands` in one round trip, fenced by `epoch` if given, and says what
    /// the replicas confirmed ([`Replication::NotAsked`] without durability set), whatever
    /// it is: for a caller that holds on to the batch and decides itself (ingest),
    /// where [`Store::apply_commands`] and [`Store::apply_fenced`] fail with
    /// [`StoreError::NotReplicated`] when the replicas fall short.
    pub async fn apply_batch(
        &self,
        commands: &[Command],
        epoch: Option<u64>,
    ) -> Result<(Vec<Result<Applied, Rejection>>, Replication), StoreError> {
        self.apply_waiting(commands, epoch).await
    }

    /// Schedules one job. See `lua/put.lua`.
    pub async fn put(&self, request: PutRequest) -> Result<PutOutcome, StoreError> {
        match self.apply_one(Op::Put(request)).await? {
            Applied::Put(outcome) => Ok(outcome),
            Applied::Delete { .. } => Err(StoreError::bad_reply("put", "delete reply")),
        }
    }

    /// Stores a recurring job (mode nx or replace, as for [`Store::put`]); `request.due`
    /// is its first occurrence.
    pub async fn put_recurring(
        &self,
        request: PutRequest,
        schedule: ScheduleSpec,
    ) -> Result<PutOutcome, StoreError> {
        self.put_jittered(request, schedule, 0).await
    }

    /// [`Store::put_recurring`] with a jitter: the first occurrence waits in the
    /// schedule for a delay in `[0, jitter_ms)` derived from topic, id and its due
    /// time (`lua/put.lua`; `jitter_ms` is the bound, `Schedule::jitter_bound`).
    pub async fn put_jittered(
        &self,
        request: PutRequest,
        schedule: ScheduleSpec,
        jitter_ms: u64,
    ) -> Result<PutOutcome, StoreError> {
        let command = Command {
            op: Op::Put(request),
            schedule: Some(schedule),
            jitter_ms,
        };
        let mut results = self.apply_commands(std::slice::from_ref(&command)).await?;
        match results.pop() {
            Some(Ok(Applied::Put(outcome))) => Ok(outcome),
            Some(Err(rejection)) => Err(rejection.into()),
            _ => Err(StoreError::bad_reply("put", "no put reply")),
        }
    }

    /// Cancels one job wherever it is; `true` if there was one. See `lua/delete.lua`.
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
    async fn apply_waiting<C: StoreCommand>(
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
                match command.op() {
                    Op::Put(request) => {
                        let put = put::Put {
                            request,
                            spec: command.schedule().map_or("", ScheduleSpec::as_str),
                            jitter_ms: command.jitter_ms(),
                        };
                        self.put_call(&put, keys, &channel, &epoch_arg)
                    }
                    Op::Delete { topic, id } => self.delete_call(topic, id, keys, &epoch_arg),
                }
            })
            .collect()
    }
}

fn decode_applied(op: &Op, value: Value) -> Result<Applied, StoreError> {
    match op {
        Op::Put(_) => Ok(Applied::Put(put::decode(value)?)),
        Op::Delete { .. } => Ok(Applied::Delete {
            removed: delete::decode(value)?,
        }),
    }
}

//! The transport: how calls reach Redis. The one place that tells a standalone Redis
//! from a Redis Cluster, and the one place that recovers from `NOSCRIPT`.
//!
//! Every call names its route: one topic (all its keys share the topic's hash tag, so
//! one slot) or global (keys outside any topic, server commands). A batch of calls
//! runs global calls first, then the topic calls, each topic's in the order given:
//! - standalone: one pipeline, one round trip;
//! - cluster (which refuses pipelines that cross slots): one pipeline per topic, all
//!   in flight at once (a topic's lone call as a plain command); global calls one by
//!   one, routed by the cluster client (`SCRIPT LOAD` goes to every primary).
//!
//! Each call gets its own result: one that Redis refused (a damaged topic, a script
//! error) does not hide the others. An unreachable Redis fails the whole batch.
//!
//! A *waiting* batch ([`Executor::run_waiting`], for `redis.wait_replicas`) ends each
//! pipeline with `CLIENT INFO` and `WAIT`: the wait covers exactly the writes that
//! pipeline carried, on the connection it names (see `durable.rs`). On a cluster every
//! call of such a batch goes in a pipeline (a global call in one of its own), so each
//! primary written to gets its own `WAIT`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use redis::{Cmd, FromRedisValue, RedisError, RedisResult, Value};

use super::call::{Ack, Call, Durability, Route};
use super::conn::{cluster_seeds, Conn};
use super::denials::CallFacts;
use super::error::{is_noscript, StoreError};
use super::health::RedisHealth;
use super::link::Link;
use super::scripts::Scripts;
use super::ConnectOptions;

/// Replies in the caller's order, and the acks of a waiting batch (none otherwise).
type Sent = (Vec<RedisResult<Value>>, Vec<Ack>);

/// Runs calls over the store's connection (replaced when it stops answering, see
/// `link.rs`), with the scripts it keeps loaded.
#[derive(Clone)]
pub(crate) struct Executor {
    conn: Link<Conn>,
    cluster: bool,
    scripts: Arc<Scripts>,
    /// Counts the times the scripts were loaded: at open, and after a `NOSCRIPT`, which
    /// means the server may have lost its data too (a restart, a failover).
    script_epoch: Arc<AtomicU64>,
    /// Told the outcome of every round trip (answered, refused for memory, written).
    health: Arc<RedisHealth>,
}

impl Executor {
    /// Connects and loads the scripts.
    pub(crate) async fn open(options: &ConnectOptions) -> Result<Self, StoreError> {
        let cluster = cluster_seeds(&options.url).is_some();
        let options = options.clone();
        let conn = Link::open(move || {
            let options = options.clone();
            async move { Conn::open(&options).await }
        })
        .await
        .map_err(StoreError::Unavailable)?;
        let executor = Self {
            conn,
            cluster,
            scripts: Arc::new(Scripts::new()),
            script_epoch: Arc::new(AtomicU64::new(0)),
            health: Arc::new(RedisHealth::new()),
        };
        executor.load_scripts().await?;
        Ok(executor)
    }

    pub(super) fn health(&self) -> &Arc<RedisHealth> {
        &self.health
    }

    pub(super) fn set_health(&mut self, health: Arc<RedisHealth>) {
        self.health = health;
    }

    /// What the health needs to know of `cmd` (on `route`): whether Redis refuses it
    /// while out of memory and its success shows that Redis accepts writes again
    /// (`put.lua`, which always adds to memory, and `INCR`), its size, and its name.
    fn facts(&self, cmd: &Cmd, route: Option<&Route>) -> CallFacts {
        let mut args = cmd.args_iter().filter_map(|arg| match arg {
            redis::Arg::Simple(bytes) => Some(bytes),
            _ => None,
        });
        let first = args.next().unwrap_or_default();
        let (grows, name) = if first.eq_ignore_ascii_case(b"EVALSHA") {
            let hash = args.next().unwrap_or_default();
            let script = self.scripts.name_of(hash).unwrap_or("a script");
            (
                hash == self.scripts.put.get_hash().as_bytes(),
                format!("{script}.lua"),
            )
        } else {
            (
                first.eq_ignore_ascii_case(b"INCR"),
                String::from_utf8_lossy(first).to_ascii_lowercase(),
            )
        };
        let name = match route {
            Some(Route::Topic(topic)) => format!("{name} on topic {:?}", topic.as_str()),
            _ => name,
        };
        let bytes = cmd
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes.len() as u64,
                _ => 0,
            })
            .sum();
        CallFacts { grows, bytes, name }
    }

    /// Runs a server command (`INFO`, `CONFIG GET`) on every primary: each node's name
    /// (`host:port` on a cluster, empty on a standalone Redis) and reply, a refusal as a
    /// [`Value::ServerError`]. The inner error: a standalone Redis refused the command;
    /// the outer one: Redis is unreachable.
    pub(super) async fn query_primaries(
        &self,
        cmd: &Cmd,
    ) -> Result<Result<Vec<(String, Value)>, RedisError>, StoreError> {
        // On a cluster each primary's address maps to its reply (no way to merge them).
        let reply = self.conn.current().on_primaries(cmd).await;
        let value = match reply {
            Ok(value) => value,
            Err(err) if err.code().is_some() => {
                self.health.observe_answer();
                return Ok(Err(err));
            }
            Err(err) => {
                self.health.observe_error(&err);
                return Err(StoreError::Unavailable(err));
            }
        };
        self.health.observe_answer();
        if !self.cluster {
            return Ok(Ok(vec![(String::new(), value)]));
        }
        match value {
            Value::Map(pairs) => Ok(Ok(pairs
                .into_iter()
                .map(|(node, reply)| {
                    let node = redis::from_redis_value::<String>(node).unwrap_or_default();
                    (node, reply)
                })
                .collect())),
            other => Ok(Ok(vec![(String::new(), other)])),
        }
    }

    pub(crate) fn scripts(&self) -> &Scripts {
        &self.scripts
    }

    /// Changes whenever the scripts had to be loaded again (see `script_epoch`): what
    /// the store remembers about the server's data is void across a change.
    pub(crate) fn script_epoch(&self) -> u64 {
        self.script_epoch.load(Ordering::Acquire)
    }

    /// Runs `calls` (see the module docs for the order) and returns one result per
    /// call, in the order given. Calls that met an empty script cache (a Redis restart,
    /// a failover to a replica) did nothing: the scripts are loaded once and those
    /// calls run again.
    pub(crate) async fn run(&self, calls: &[Call]) -> Result<Vec<RedisResult<Value>>, StoreError> {
        // An empty pipeline is a client error in the redis crate ("empty command"),
        // which would surface as `Unavailable` and make a caller retry nothing forever.
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.run_acked(calls, None).await?.0)
    }

    /// [`Executor::run`], each pipeline ending with `CLIENT INFO` and `WAIT` for
    /// `wait.replicas` (blocking up to `wait.timeout`): the results, and one [`Ack`] per
    /// pipeline sent. With no calls, a standalone Redis still answers one ack (which
    /// connection this is, and what its earlier writes reached).
    pub(super) async fn run_waiting(
        &self,
        calls: &[Call],
        wait: &Durability,
    ) -> Result<Sent, StoreError> {
        self.run_acked(calls, Some(wait)).await
    }

    async fn run_acked(
        &self,
        calls: &[Call],
        wait: Option<&Durability>,
    ) -> Result<Sent, StoreError> {
        let sent = self.run_unobserved(calls, wait).await;
        match &sent {
            Ok((replies, _)) => self.health.observe_replies(replies, &|i| {
                self.facts(&calls[i].cmd, Some(&calls[i].route))
            }),
            Err(StoreError::Unavailable(err)) => self.health.observe_error(err),
            Err(_) => {}
        }
        sent
    }

    async fn run_unobserved(
        &self,
        calls: &[Call],
        wait: Option<&Durability>,
    ) -> Result<Sent, StoreError> {
        let (mut replies, mut acks) = self.send(&calls.iter().collect::<Vec<_>>(), wait).await?;
        let lost: Vec<usize> = (0..replies.len())
            .filter(|&i| matches!(&replies[i], Err(err) if is_noscript(err)))
            .collect();
        if !lost.is_empty() {
            self.load_scripts().await?;
            let again: Vec<&Call> = lost.iter().map(|&i| &calls[i]).collect();
            // Both sends wrote: the acks of both must hold.
            let (replies_again, acks_again) = self.send(&again, wait).await?;
            acks.extend(acks_again);
            for (i, reply) in lost.into_iter().zip(replies_again) {
                replies[i] = reply;
            }
        }
        Ok((replies, acks))
    }

    /// One call; its refusal is the error.
    pub(crate) async fn run_one(&self, call: Call) -> Result<Value, StoreError> {
        let mut replies = self.run(std::slice::from_ref(&call)).await?;
        match replies.pop() {
            Some(reply) => Ok(reply?),
            None => Err(StoreError::bad_reply("redis", "a call got no reply")),
        }
    }

    /// A plain command outside the scripts (`TIME`, `PING`, `SSCAN`…).
    pub(crate) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        let reply: RedisResult<Value> = cmd.query_async(&mut self.conn.clone()).await;
        match &reply {
            Err(err) if err.code().is_none() => self.health.observe_error(err),
            _ => self
                .health
                .observe_replies(std::slice::from_ref(&reply), &|_| self.facts(cmd, None)),
        }
        Ok(redis::from_redis_value(reply?).map_err(RedisError::from)?)
    }

    /// `SCRIPT LOAD`s every script; on a cluster each load goes to every primary.
    async fn load_scripts(&self) -> Result<(), StoreError> {
        let loads = self.scripts.loads();
        for reply in self.send(&loads.iter().collect::<Vec<_>>(), None).await?.0 {
            reply?;
        }
        self.script_epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    async fn send(&self, calls: &[&Call], wait: Option<&Durability>) -> Result<Sent, StoreError> {
        // Global calls first, then topic calls; `order[k]` is the caller's index of the
        // k-th call sent.
        let order: Vec<usize> = (0..calls.len())
            .filter(|&i| calls[i].route == Route::Global)
            .chain((0..calls.len()).filter(|&i| calls[i].route != Route::Global))
            .collect();
        let mut replies: Vec<RedisResult<Value>> = Vec::with_capacity(calls.len());
        replies.resize_with(calls.len(), || Ok(Value::Nil));
        let mut acks = Vec::new();
        if !self.cluster {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &i in &order {
                pipe.add_command(calls[i].cmd.clone());
            }
            if let Some(wait) = wait {
                ask_wait(&mut pipe, wait);
            }
            let mut values: Vec<Value> = pipe.query_async(&mut self.conn.clone()).await?;
            if wait.is_some() {
                acks.push(take_ack(&mut values, None)?);
            }
            for (&i, value) in order.iter().zip(values) {
                replies[i] = own_result(value);
            }
            return Ok((replies, acks));
        }

        // Each global call alone: they may live in different slots.
        let globals: Vec<Vec<usize>> = order
            .iter()
            .filter(|&&i| calls[i].route == Route::Global)
            .map(|&i| vec![i])
            .collect();
        let mut topics: Vec<Vec<usize>> = Vec::new();
        let mut group_of: HashMap<&Route, usize> = HashMap::new();
        for &i in order.iter().filter(|&&i| calls[i].route != Route::Global) {
            let group = *group_of.entry(&calls[i].route).or_insert_with(|| {
                topics.push(Vec::new());
                topics.len() - 1
            });
            topics[group].push(i);
        }
        for groups in [globals, topics] {
            let done = futures_util::future::join_all(
                groups
                    .iter()
                    .map(|members| self.send_group(calls, members, wait)),
            )
            .await;
            for (members, sent) in groups.iter().zip(done) {
                let (results, ack) = sent?;
                acks.extend(ack);
                for (&i, result) in members.iter().zip(results) {
                    replies[i] = result;
                }
            }
        }
        Ok((replies, acks))
    }

    /// One group of calls on a cluster (one route), as one pipeline, or as a plain
    /// command when it is a lone call of a batch that does not wait: then the cluster
    /// client follows MOVED/ASK and retries it on its own during a failover.
    async fn send_group(
        &self,
        calls: &[&Call],
        members: &[usize],
        wait: Option<&Durability>,
    ) -> Result<(Vec<RedisResult<Value>>, Option<Ack>), StoreError> {
        let mut conn = self.conn.clone();
        if let ([i], None) = (members, wait) {
            return Ok((
                vec![calls[*i].cmd.query_async::<Value>(&mut conn).await],
                None,
            ));
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for &i in members {
            pipe.add_command(calls[i].cmd.clone());
        }
        if let Some(wait) = wait {
            ask_wait(&mut pipe, wait);
        }
        let mut values = pipe.query_async::<Vec<Value>>(&mut conn).await?;
        let ack = match (wait, members.first()) {
            (Some(_), Some(&first)) => {
                Some(take_ack(&mut values, Some(calls[first].route.clone()))?)
            }
            _ => None,
        };
        Ok((values.into_iter().map(own_result).collect(), ack))
    }
}

/// Ends a pipeline with the questions of a waiting batch: which connection is this, and
/// how many replicas hold its writes (`WAIT` blocks until `wait.replicas` do, or
/// `wait.timeout` passed).
fn ask_wait(pipe: &mut redis::Pipeline, wait: &Durability) {
    pipe.cmd("CLIENT").arg("INFO");
    pipe.cmd("WAIT")
        .arg(wait.replicas)
        .arg(u64::try_from(wait.timeout.as_millis()).unwrap_or(u64::MAX));
}

/// Takes the answers of [`ask_wait`] off the end of a pipeline's values. A refusal (an
/// ACL without `wait` or `client|info`, a replica in place of a primary) fails the batch.
fn take_ack(values: &mut Vec<Value>, route: Option<Route>) -> Result<Ack, StoreError> {
    let (Some(replicas), Some(info)) = (values.pop(), values.pop()) else {
        return Err(StoreError::bad_reply(
            "redis",
            "a waiting pipeline lost its WAIT reply",
        ));
    };
    let replicas: i64 = redis::from_redis_value(own_result(replicas)?)
        .map_err(|e| StoreError::bad_reply("redis", format!("WAIT: {e}")))?;
    let info: String = redis::from_redis_value(own_result(info)?)
        .map_err(|e| StoreError::bad_reply("redis", format!("CLIENT INFO: {e}")))?;
    let connection = connection_of(&info);
    // Without an identity a later WAIT could not be told from one on a new connection.
    if connection.is_empty() {
        return Err(StoreError::bad_reply(
            "redis",
            format!("CLIENT INFO: {info:?}"),
        ));
    }
    Ok(Ack {
        route,
        connection,
        replicas: u32::try_from(replicas).unwrap_or(0),
    })
}

/// The fields of a `CLIENT INFO` line that name one connection: its id on the server
/// (ids restart after a server restart, hence the addresses), our end and the server's.
fn connection_of(client_info: &str) -> String {
    client_info
        .split_whitespace()
        .filter(|field| {
            field.starts_with("id=") || field.starts_with("addr=") || field.starts_with("laddr=")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A pipeline reply with the command's own error as an `Err`.
fn own_result(value: Value) -> RedisResult<Value> {
    match value {
        Value::ServerError(err) => Err(RedisError::from(err)),
        value => Ok(value),
    }
}

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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use redis::{Cmd, FromRedisValue, RedisError, RedisResult, Value};

use super::conn::{cluster_seeds, Conn};
use super::error::{is_noscript, StoreError};
use super::link::Link;
use super::scripts::Scripts;
use super::ConnectOptions;
use crate::job::Topic;

/// One command of a batch, with where it must go.
pub(crate) struct Call {
    route: Route,
    cmd: Cmd,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum Route {
    /// Keys under one topic's hash tag.
    Topic(Topic),
    /// Keys outside any topic (the topic set), or no key at all.
    Global,
}

impl Call {
    pub(crate) fn on_topic(topic: &Topic, cmd: Cmd) -> Self {
        Self {
            route: Route::Topic(topic.clone()),
            cmd,
        }
    }

    pub(crate) fn global(cmd: Cmd) -> Self {
        Self {
            route: Route::Global,
            cmd,
        }
    }

    pub(crate) fn cmd_mut(&mut self) -> &mut Cmd {
        &mut self.cmd
    }
}

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
        };
        executor.load_scripts().await?;
        Ok(executor)
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
        let mut replies = self.send(&calls.iter().collect::<Vec<_>>()).await?;
        let lost: Vec<usize> = (0..replies.len())
            .filter(|&i| matches!(&replies[i], Err(err) if is_noscript(err)))
            .collect();
        if !lost.is_empty() {
            self.load_scripts().await?;
            let again: Vec<&Call> = lost.iter().map(|&i| &calls[i]).collect();
            for (i, reply) in lost.into_iter().zip(self.send(&again).await?) {
                replies[i] = reply;
            }
        }
        Ok(replies)
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
        Ok(cmd.query_async(&mut self.conn.clone()).await?)
    }

    /// `SCRIPT LOAD`s every script; on a cluster each load goes to every primary.
    async fn load_scripts(&self) -> Result<(), StoreError> {
        let loads = self.scripts.loads();
        for reply in self.send(&loads.iter().collect::<Vec<_>>()).await? {
            reply?;
        }
        self.script_epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    async fn send(&self, calls: &[&Call]) -> Result<Vec<RedisResult<Value>>, StoreError> {
        // Global calls first, then topic calls; `order[k]` is the caller's index of the
        // k-th call sent.
        let order: Vec<usize> = (0..calls.len())
            .filter(|&i| calls[i].route == Route::Global)
            .chain((0..calls.len()).filter(|&i| calls[i].route != Route::Global))
            .collect();
        let mut replies: Vec<RedisResult<Value>> = Vec::with_capacity(calls.len());
        replies.resize_with(calls.len(), || Ok(Value::Nil));
        if !self.cluster {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &i in &order {
                pipe.add_command(calls[i].cmd.clone());
            }
            let values: Vec<Value> = pipe.query_async(&mut self.conn.clone()).await?;
            for (&i, value) in order.iter().zip(values) {
                replies[i] = own_result(value);
            }
            return Ok(replies);
        }

        let globals: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&i| calls[i].route == Route::Global)
            .collect();
        let done = futures_util::future::join_all(globals.iter().map(|&i| {
            let mut conn = self.conn.clone();
            async move { calls[i].cmd.query_async::<Value>(&mut conn).await }
        }))
        .await;
        for (&i, reply) in globals.iter().zip(done) {
            replies[i] = reply;
        }

        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut group_of: HashMap<&Route, usize> = HashMap::new();
        for &i in order.iter().filter(|&&i| calls[i].route != Route::Global) {
            let group = *group_of.entry(&calls[i].route).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[group].push(i);
        }
        let done = futures_util::future::join_all(groups.iter().map(|members| {
            let mut conn = self.conn.clone();
            async move {
                // A lone call goes as a plain command: the cluster client follows
                // MOVED/ASK and retries it on its own during a failover.
                if let [i] = members[..] {
                    return Ok(vec![calls[i].cmd.query_async::<Value>(&mut conn).await]);
                }
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for &i in members {
                    pipe.add_command(calls[i].cmd.clone());
                }
                let values = pipe.query_async::<Vec<Value>>(&mut conn).await?;
                Ok::<_, RedisError>(values.into_iter().map(own_result).collect())
            }
        }))
        .await;
        for (members, results) in groups.iter().zip(done) {
            for (&i, result) in members.iter().zip(results?) {
                replies[i] = result;
            }
        }
        Ok(replies)
    }
}

/// A pipeline reply with the command's own error as an `Err`.
fn own_result(value: Value) -> RedisResult<Value> {
    match value {
        Value::ServerError(err) => Err(RedisError::from(err)),
        value => Ok(value),
    }
}

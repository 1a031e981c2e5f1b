//! What a store call is, before any transport sees it: a command with its route (one
//! topic's slot, or global), and the durability a write may wait for. `exec.rs` runs
//! calls, `scripts.rs` builds script calls, `durable.rs` judges what the replicas
//! confirmed; all three share these types and none needs the others for them.

use std::time::Duration;

use redis::{Cmd, ToRedisArgs};

use crate::job::Topic;

/// How many replicas must confirm a write before it counts, and how long one `WAIT`
/// may block for them (`redis.wait_replicas`, `redis.wait_timeout_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Durability {
    pub replicas: u32,
    pub timeout: Duration,
}

/// One command of a batch, with where it must go.
pub(crate) struct Call {
    pub(super) route: Route,
    pub(super) cmd: Cmd,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Route {
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

/// What the `CLIENT INFO` + `WAIT` at the end of one pipeline of a waiting batch said.
#[derive(Debug, Clone)]
pub(super) struct Ack {
    /// The pipeline's route on a cluster; `None` on a standalone Redis, where one
    /// connection carries the whole batch.
    pub(super) route: Option<Route>,
    /// Which connection carried the pipeline (`CLIENT INFO`'s `id`, `addr`, `laddr`).
    pub(super) connection: String,
    /// Replicas that confirmed every write made on that connection so far.
    pub(super) replicas: u32,
}

impl Call {
    /// Appends one script argument (`ARGV` in order).
    pub(crate) fn arg(mut self, arg: impl ToRedisArgs) -> Self {
        self.cmd_mut().arg(arg);
        self
    }
}

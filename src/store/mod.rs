//! The job store: typed calls over the Lua scripts of `lua/`.
//!
//! This is the only module that knows key names, scripts or Redis clients. Everything
//! the bridge, the CLI and the HTTP API do to jobs goes through [`Store`], and through
//! the same scripts any other Redis client can call (see `lua/README.md`).
//!
//! `ops/` holds one file per operation (its request and reply types, its calls, its
//! reply decoding and its methods; see `ops/mod.rs`). The rest is what they share:
//! - `types.rs`: the types several operations take or answer (limits, job state, last
//!   error, lease; a series' schedule spec is the job's vocabulary, `crate::job::spec`);
//! - `scripts.rs`: the one list of scripts, and how a script call is built;
//! - `call.rs`: what a call is (command, route, `Durability`);
//! - `exec.rs`: the transport (standalone or cluster, pipelining, `NOSCRIPT`);
//! - `keys.rs`: key names; `reply.rs`: reply decoding; `error.rs`: the error boundary;
//! - `notify.rs`: the Pub/Sub notifications and the [`DueHints`] they feed;
//! - `registry.rs`: the topics set, and what the store remembers registering in it;
//! - `conn.rs`, `link.rs`: opening connections and replacing dead ones;
//! - `durable.rs`: waiting for replicas (`WAIT`) after job writes (`redis.wait_replicas`);
//! - `health.rs`: is Redis answering, refusing writes (OOM), may it evict keys;
//!   `denials.rs`: calls it refuses for lack of permission (ACL).
//!
//! Adding a script: `lua/<name>.lua`, its name in the list of `scripts.rs`, and its
//! file in `ops/` (declared in `ops/mod.rs`, its public types re-exported here).

mod call;
mod conn;
mod denials;
mod durable;
mod error;
mod exec;
mod health;
mod keys;
mod link;
mod notify;
mod ops;
mod registry;
mod reply;
mod scripts;
mod types;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use call::Durability;
pub use conn::cluster_seeds;
pub use denials::DENIAL_WINDOW;
pub use durable::{Replication, WriteMark};
pub use error::{RejectCode, Rejection, StoreError};
use exec::Executor;
pub use health::{
    policy_keeps_jobs, Eviction, HealthView, NodeHealth, Probe, RedisHealth, HEALTH_PROBE_INTERVAL,
    ROOM_PERCENT,
};
pub use keys::{KeySpace, TopicKeys};
pub use notify::{DueHints, SUBSCRIPTION_PING_INTERVAL};
pub use ops::{
    Applied, Batch, CheckReport, Command, Delivered, DueHistogram, Expired, HealthOp, HistoryEntry,
    JobInfo, JobSummary, ListWhich, NextDue, Noted, Op, Outcome, PrefixStep, Problem, PutOutcome,
    PutRequest, PutStatus, RateSource, RateState, RecordedPartitions, Redriven, Requeued,
    ReservedJob, RetryOutcome, TargetHealth, TopicStats, WindowStep, CHECK_STEP,
    MAX_HISTOGRAM_BUCKETS, MAX_HISTOGRAM_WINDOW_MS, PREFIX_STEP,
};
use registry::TopicRegistry;
pub use registry::DEFAULT_TOPIC_REFRESH;
pub use scripts::SOURCES as SCRIPT_SOURCES;
pub use types::{JobState, LastError, Lease, Limits, DEFAULT_HISTORY_MAX, MAX_BATCH};

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub url: String,
    pub prefix: String,
    pub connect_timeout: Duration,
    /// A reply slower than this fails the call (as unavailable) instead of hanging.
    pub response_timeout: Duration,
    /// PEM file of CAs trusted besides the system roots on a `rediss://` link
    /// (`redis.tls_ca_file`).
    pub tls_ca_file: Option<PathBuf>,
}

#[derive(Clone)]
pub struct Store {
    exec: Executor,
    /// Kept for the Pub/Sub subscription, which needs a connection of its own.
    options: Arc<ConnectOptions>,
    keys: KeySpace,
    limits: Limits,
    /// Cap of each topic's outcome history (`history.max_per_topic`); 0 writes none.
    history_max: u32,
    /// Replicas that must confirm job writes (`durable.rs`); `None`: no waiting.
    durability: Option<Durability>,
    /// Shared by the clones, so a topic is registered once per refresh, not per clone.
    registry: Arc<TopicRegistry>,
    /// The configuration's `[[policies]]`: default rate limits passed to every reserve.
    policies: Arc<crate::policy::Policies>,
}

impl std::fmt::Debug for Store {
    // The executor holds live connections; what identifies a store is where and what.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("url", &crate::urls::redact_url(&self.options.url))
            .field("keys", &self.keys)
            .field("limits", &self.limits)
            .field("history_max", &self.history_max)
            .field("durability", &self.durability)
            .field("topic_refresh", &self.registry.refresh())
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Connects and loads the scripts. Later reconnects (and `NOSCRIPT` after a Redis
    /// restart) are handled inside; callers only see [`StoreError::Unavailable`].
    pub async fn connect(options: &ConnectOptions, limits: Limits) -> Result<Self, StoreError> {
        let exec = Executor::open(options).await?;
        Ok(Self {
            exec,
            options: Arc::new(options.clone()),
            keys: KeySpace::new(options.prefix.clone()),
            limits,
            history_max: DEFAULT_HISTORY_MAX,
            durability: None,
            registry: Arc::new(TopicRegistry::new(DEFAULT_TOPIC_REFRESH)),
            policies: Arc::default(),
        })
    }

    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    /// A clone (same connections) whose fenced writes use command partition `k`'s
    /// fence key, so the ingest sessions of different partitions, writing one topic at
    /// once, never fence each other out.
    pub fn for_partition(&self, k: u16) -> Self {
        let mut store = self.clone();
        store.keys = self.keys.for_partition(k);
        store
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Caps each topic's history at `max` entries (0 writes none); default
    /// [`DEFAULT_HISTORY_MAX`].
    pub fn with_history_max(mut self, max: u32) -> Self {
        self.history_max = max;
        self
    }

    /// The default rate limits (`[[policies]]`) reserve passes for topics without a
    /// live limit.
    pub fn with_policies(mut self, policies: crate::policy::Policies) -> Self {
        self.policies = Arc::new(policies);
        self
    }

    pub fn policies(&self) -> &crate::policy::Policies {
        &self.policies
    }

    pub fn history_max(&self) -> u32 {
        self.history_max
    }

    /// Re-adds a topic to the topics set at its first put after `every` (default
    /// [`DEFAULT_TOPIC_REFRESH`]), not at every batch: how long a set deleted by hand
    /// may miss a topic that is still being put to. Starts afresh for this store and
    /// the clones made from it later.
    pub fn with_topic_refresh(mut self, every: Duration) -> Self {
        self.registry = Arc::new(TopicRegistry::new(every));
        self
    }
}

//! Shared by the integration tests: real Redis and RabbitMQ, isolated per test by a
//! unique key prefix and unique exchange/queue names, cleaned up on drop. What the
//! benchmark needs too lives in the `redisched-testkit` workspace crate.
// Test helpers: each test file uses some of them (`dead_code`), and `pub` is for the
// test files that `mod common;` (`unreachable_pub`).
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use redisched::store::{ConnectOptions, Limits, Store};

pub const HOW_TO_START_REDIS: &str = "start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no  (or set TEST_REDIS_URL)";
pub const HOW_TO_START_RABBITMQ: &str =
    "start it with: rabbitmq-server -detached  (or set TEST_AMQP_URL)";

pub fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into())
}

pub fn amqp_url() -> String {
    std::env::var("TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The scripts' full key list (lua/README.md, "Key schema"), spelled out as any other
/// client of the scripts would: kept apart from the crate's own constant on purpose.
pub const FULL_KEY_NAMES: [&str; 8] = [
    "scheduled",
    "reserved",
    "jobs",
    "seq",
    "damaged",
    "paused",
    "history",
    "failing",
];

/// `topic`'s keys under `prefix`, by name, in the order given.
pub fn topic_keys<'a>(
    prefix: &str,
    topic: &str,
    names: impl IntoIterator<Item = &'a str>,
) -> Vec<String> {
    names
        .into_iter()
        .map(|k| format!("{prefix}:{{{topic}}}:{k}"))
        .collect()
}

/// A name no other test (or earlier run) uses: `t<label>-<pid>-<time>-<n>`.
pub fn unique(label: &str) -> String {
    redisched_testkit::unique(&format!("t{label}"))
}

pub const DEFAULT_LIMITS: Limits = Limits {
    max_delay_ms: 366 * 24 * 3_600_000,
    max_body_bytes: 1 << 20,
};

/// A store under its own key prefix; every key under it is deleted on drop.
pub struct TestStore {
    pub store: Store,
    pub prefix: String,
}

impl std::ops::Deref for TestStore {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.store
    }
}

pub async fn test_store() -> TestStore {
    test_store_with(DEFAULT_LIMITS).await
}

/// A store on an existing prefix (e.g. a bridge's), not cleaned up by this handle.
pub async fn test_store_named(prefix: &str) -> Store {
    let options = ConnectOptions {
        url: redis_url(),
        prefix: prefix.to_string(),
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(5),
        tls_ca_file: None,
    };
    Store::connect(&options, DEFAULT_LIMITS)
        .await
        .unwrap_or_else(|err| {
            panic!(
                "cannot reach Redis at {}: {err}\n{HOW_TO_START_REDIS}",
                redis_url()
            )
        })
}

/// A store on an existing prefix (a bridge's), whose keys are deleted when it drops.
pub async fn test_store_owning(prefix: &str) -> TestStore {
    TestStore {
        store: test_store_named(prefix).await,
        prefix: prefix.to_string(),
    }
}

pub async fn test_store_with(limits: Limits) -> TestStore {
    let prefix = unique("store");
    let options = ConnectOptions {
        url: redis_url(),
        prefix: prefix.clone(),
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(5),
        tls_ca_file: None,
    };
    let store = match Store::connect(&options, limits).await {
        Ok(store) => store,
        Err(err) => panic!(
            "cannot reach Redis at {}: {err}\n{HOW_TO_START_REDIS}",
            redis_url()
        ),
    };
    TestStore { store, prefix }
}

/// Deletes every key under `prefix` (used on drop, also after a failed assertion).
pub fn delete_prefix(prefix: &str) {
    let _ = redisched_testkit::delete_prefix(&redis_url(), prefix);
}

impl Drop for TestStore {
    fn drop(&mut self) {
        delete_prefix(&self.prefix);
    }
}

/// A plain synchronous Redis connection for inspecting raw keys in tests.
/// A put of `id` on `topic` (body `x`, an existing job kept), as a command to apply.
pub fn put_op(topic: &str, id: &str, due: redisched::job::Due) -> redisched::store::Op {
    use redisched::job::{JobId, PutMode, Topic};
    redisched::store::Op::Put(redisched::store::PutRequest {
        topic: Topic::new(topic).unwrap(),
        id: JobId::new(id).unwrap(),
        body: b"x".to_vec(),
        meta: Vec::new(),
        due,
        mode: PutMode::Keep,
    })
}

pub fn raw_redis() -> redis::Connection {
    redis::Client::open(redis_url())
        .and_then(|c| c.get_connection())
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach Redis at {}: {e}\n{HOW_TO_START_REDIS}",
                redis_url()
            )
        })
}
pub mod api;
pub mod bridge;
pub mod cluster;
pub mod faults;
pub mod otlp;
pub mod receiver;
pub mod route;
pub mod timed;
pub mod verifiers;

//! Fault injection for `tests/faults/bridge_faults.rs` and `tests/chaos.rs`, without touching the
//! shared services: [`services`] (a private `redis-server` and RabbitMQ node the test
//! owns), [`proxy`] (a TCP proxy that cuts or hangs connections) and [`ledger`] (the
//! load, what the broker confirmed, what was delivered, and the verdict), plus the
//! fault tests' bridge settings, bridges as child processes and cleanup here.

mod bounded;
mod ledger;
mod proxy;
mod services;

// Tests import from `common::faults` as before; not every test binary uses all of it.
#[allow(unused_imports)]
pub use {bounded::*, ledger::*, proxy::*, services::*};

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use lapin::options::*;
use lapin::{Channel, Connection, ConnectionProperties};
use redisched::config::Config;

use super::bridge::{test_config, ChildBridge};

/// Small windows so that the duplicate bounds are tight; fast failure detection.
pub fn fault_config(label: &str) -> Config {
    let mut config = test_config(label);
    config.dispatch.ttr_ms = 3_000;
    config.dispatch.window = 200;
    config.dispatch.batch = 100;
    config.ingest.prefetch = 200;
    config.ingest.batch = 100;
    config.amqp.heartbeat_secs = 2;
    config.redis.response_timeout_ms = 1_000;
    config.redis.connect_timeout_ms = 1_000;
    config
}

/// Duplicates one fault may cause (README, *Guarantees*): a confirm window of
/// published-but-unreleased jobs plus a prefetch of applied-but-unacked commands.
pub fn dup_bound(config: &Config, faults: usize) -> usize {
    faults * (config.dispatch.window + usize::from(config.ingest.prefetch))
}

/// A `redisched run` child with every setting of `config`, logging to `log`.
pub fn spawn_bridge(config: &Config, log: &Path) -> ChildBridge {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("bridge log file");
    let err = out.try_clone().expect("bridge log file");
    let mut config = config.clone();
    config.log.level = "redisched=info,lapin=error".into();
    ChildBridge::start_logging(&config, Stdio::from(out), Stdio::from(err))
}

/// Number of messages ready in a queue (passive declare); `None` if it cannot be read.
pub async fn queue_depth(channel: &Channel, queue: &str) -> Option<u32> {
    redisched_testkit::queue_depth(channel, queue).await.ok()
}

/// Deletes the exchanges and queues of `config` on the broker at `url` (best effort).
pub async fn cleanup_amqp(url: &str, config: &Config) {
    let Ok(Ok(conn)) = tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    else {
        return;
    };
    if let Ok(channel) = conn.create_channel().await {
        let a = &config.amqp;
        for queue in [&a.commands_queue, &a.invalid_queue, &a.expired_queue] {
            let _ = channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        for exchange in [
            &a.commands_exchange,
            &a.invalid_exchange,
            &a.expired_exchange,
            &a.ready_exchange,
        ] {
            let _ = channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
    }
    let _ = conn.close(200, "bye".into()).await;
}

/// How long [`AmqpCleanup`] may take: the broker answers deletes in milliseconds.
const CLEANUP_LIMIT: Duration = Duration::from_secs(30);

/// Deletes the test's exchanges and queues (and the collector's queue) on the broker
/// at `url` when dropped, also after a failed assertion.
pub struct AmqpCleanup {
    pub url: String,
    pub config: Config,
}

impl Drop for AmqpCleanup {
    fn drop(&mut self) {
        let (url, config) = (self.url.clone(), self.config.clone());
        // Drop cannot await, and may run inside the test's runtime: use a thread with
        // a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            // Bounded: a cleanup that hangs must not hold the test (nor CI) with it.
            let cleanup = async {
                cleanup_amqp(&url, &config).await;
                let collector = format!("{}.collector", config.redis.prefix);
                if let Ok(Ok(conn)) = tokio::time::timeout(
                    Duration::from_secs(5),
                    Connection::connect(&url, ConnectionProperties::default()),
                )
                .await
                {
                    if let Ok(channel) = conn.create_channel().await {
                        let _ = channel
                            .queue_delete(collector.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                    let _ = conn.close(200, "bye".into()).await;
                }
            };
            let _ = runtime.block_on(async { tokio::time::timeout(CLEANUP_LIMIT, cleanup).await });
        });
        let _ = cleanup.join();
    }
}

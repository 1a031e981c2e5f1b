//! Counters and gauges the bridge keeps, exported by `GET /metrics` in the classic
//! Prometheus text format (0.0.4) or in OpenMetrics, as the scraper asks ([`Format`]).
//! Per-topic gauges are a snapshot of what each topic holds now, read from Redis at
//! scrape time and handed over with [`Metrics::set_topics`].
//!
//! This file owns the registry: every family the stages update, registered in one place,
//! and the AMQP readiness of the stages. The per-topic gauges are in `topics.rs`, the
//! webhook targets' metrics and live state in `webhook.rs`, the two exposition formats in
//! `format.rs`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

mod format;
mod topics;
mod webhook;

pub use format::Format;
pub use topics::TopicSnapshot;
pub use webhook::{TargetLabels, TargetMeter, TargetStatus, WebhookLabels, WebhookMetrics};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommandLabels {
    /// `put`, `replace`, `delete`, `delete-prefix`, or `unknown` when the op could not be
    /// read.
    pub op: String,
    /// `scheduled`, `replaced`, `duplicate`, `deleted`, `not_found`, `invalid`; over HTTP
    /// also `unavailable` (Redis) and `error`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TopicLabels {
    pub topic: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// `nack`, `unroutable` or `error`.
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShortfallLabels {
    /// `timeout` or `connection_replaced`.
    pub reason: String,
}

/// Every `reason` of `redisched_replication_shortfalls_total`, exposed at 0 from the
/// start: fewer replicas than `redis.wait_replicas` confirmed a batch within
/// `redis.wait_timeout_ms`, or the connection that wrote it was replaced (the batch is
/// applied again).
pub const SHORTFALL_REASONS: [&str; 2] = ["timeout", "connection_replaced"];

/// The stages that hold an AMQP connection of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    Ingest = 1,
    Dispatch = 2,
}

impl Stage {
    const ALL: u8 = Stage::Ingest as u8 | Stage::Dispatch as u8;

    pub fn name(self) -> &'static str {
        match self {
            Stage::Ingest => "ingest",
            Stage::Dispatch => "dispatch",
        }
    }
}

/// Every `reason` of `redisched_publish_retries_total`, exposed at 0 from the start.
pub const RETRY_REASONS: [&str; 3] = ["nack", "unroutable", "error"];

/// The (op, outcome) pairs of `redisched_commands_total` exposed at 0 from the start, so
/// that `rate()` and alerts see a series before the first such command. Other pairs
/// (invalid commands, errors) appear when they first happen.
const COMMON_COMMANDS: [(&str, &str); 6] = [
    ("put", "scheduled"),
    ("put", "duplicate"),
    ("replace", "scheduled"),
    ("replace", "replaced"),
    ("delete", "deleted"),
    ("delete", "not_found"),
];
#[derive(Debug)]
pub struct Metrics {
    pub commands: Family<CommandLabels, Counter>,
    pub invalid_commands: Counter,
    pub jobs_dispatched: Counter,
    /// Jobs not delivered by due + expires-after, set aside to the expired exchange.
    pub jobs_expired: Family<TopicLabels, Counter>,
    pub publish_retries: Family<RetryLabels, Counter>,
    pub unroutable_returns: Counter,
    pub jobs_requeued: Counter,
    pub corrupt_records: Counter,
    pub publishes_in_flight: Gauge,
    pub lateness: Histogram,
    pub replication_shortfalls: Family<ShortfallLabels, Counter>,
    pub replication_wait: Histogram,
    pub redis_up: Gauge,
    pub redis_oom: Gauge,
    pub redis_acl_denied: Gauge,
    pub redis_eviction_policy_ok: Gauge,
    pub redis_evicted_keys: Gauge,
    pub amqp_up: Gauge,
    pub webhooks: WebhookMetrics,
    registry: Registry,
    /// The latest per-topic snapshot; replaced whole by [`Metrics::set_topics`].
    topics: Mutex<BTreeMap<String, TopicSnapshot>>,
    /// One bit per AMQP stage whose connection is open with the topology declared.
    stages_ready: AtomicU8,
}

impl Metrics {
    #[allow(
        clippy::too_many_lines,
        reason = "registers every metric in one place, the list README's metrics table mirrors"
    )]
    pub fn new() -> Self {
        let commands = Family::<CommandLabels, Counter>::default();
        let invalid_commands = Counter::default();
        let jobs_dispatched = Counter::default();
        let jobs_expired = Family::<TopicLabels, Counter>::default();
        let publish_retries = Family::<RetryLabels, Counter>::default();
        for reason in RETRY_REASONS {
            // Created at zero, so that the series exist before the first event.
            drop(publish_retries.get_or_create(&RetryLabels {
                reason: reason.into(),
            }));
        }
        for (op, outcome) in COMMON_COMMANDS {
            // Created at zero, so that the series exist before the first event.
            drop(commands.get_or_create(&CommandLabels {
                op: op.into(),
                outcome: outcome.into(),
            }));
        }
        let unroutable_returns = Counter::default();
        let jobs_requeued = Counter::default();
        let corrupt_records = Counter::default();
        let publishes_in_flight = Gauge::default();
        // 1 ms .. ~65 s: precision matters at the low end.
        let lateness = Histogram::new([
            0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ]);
        let replication_shortfalls = Family::<ShortfallLabels, Counter>::default();
        for reason in SHORTFALL_REASONS {
            // Created at zero, so that the series exist before the first event.
            drop(replication_shortfalls.get_or_create(&ShortfallLabels {
                reason: reason.into(),
            }));
        }
        // 0.5 ms (a replica on the LAN) .. 60 s (a stalled replica).
        let replication_wait = Histogram::new([
            0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0,
        ]);
        let redis_up = Gauge::default();
        let redis_oom = Gauge::default();
        let redis_acl_denied = Gauge::default();
        let redis_eviction_policy_ok = Gauge::default();
        redis_eviction_policy_ok.set(-1);
        let redis_evicted_keys = Gauge::default();
        redis_evicted_keys.set(-1);
        let amqp_up = Gauge::default();

        let mut registry = Registry::with_prefix("redisched");
        registry.register(
            "commands",
            "Commands applied, by op and outcome",
            commands.clone(),
        );
        registry.register(
            "invalid_commands",
            "Commands set aside to the invalid exchange",
            invalid_commands.clone(),
        );
        registry.register(
            "jobs_dispatched",
            "Jobs published, confirmed by the broker and released",
            jobs_dispatched.clone(),
        );
        registry.register(
            "jobs_expired",
            "Jobs not delivered by their due time + expires-after, set aside (confirmed) to the expired exchange and released, by topic",
            jobs_expired.clone(),
        );
        registry.register(
            "publish_retries",
            "Publishes to retry later, by reason",
            publish_retries.clone(),
        );
        registry.register(
            "unroutable_returns",
            "Jobs the broker returned as unroutable (kept and retried)",
            unroutable_returns.clone(),
        );
        registry.register(
            "jobs_requeued",
            "Reservations whose time-to-run expired, made due again",
            jobs_requeued.clone(),
        );
        registry.register(
            "corrupt_records",
            "Scheduled ids whose record was missing or unreadable",
            corrupt_records.clone(),
        );
        registry.register(
            "publishes_in_flight",
            "Publishes awaiting a broker confirm",
            publishes_in_flight.clone(),
        );
        registry.register(
            "dispatch_lateness_seconds",
            "Time from a job's due time to its confirmed publish",
            lateness.clone(),
        );
        registry.register(
            "replication_shortfalls",
            "Command batches held unacked because fewer replicas than redis.wait_replicas confirmed them, by reason",
            replication_shortfalls.clone(),
        );
        registry.register(
            "replication_wait_seconds",
            "Time from sending a command batch to Redis to its replicas' confirmation (redis.wait_replicas > 0)",
            replication_wait.clone(),
        );
        registry.register("redis_up", "1 while Redis answers", redis_up.clone());
        registry.register(
            "redis_oom",
            "1 while Redis refuses writes for lack of memory (maxmemory reached, nothing to evict)",
            redis_oom.clone(),
        );
        registry.register(
            "redis_acl_denied",
            "1 while Redis refuses a call the bridge makes for lack of permission (the Redis user's ACL lacks a command it needs)",
            redis_acl_denied.clone(),
        );
        registry.register(
            "redis_eviction_policy_ok",
            "1 when every Redis primary's maxmemory-policy keeps jobs (noeviction, volatile-*), 0 when one may evict them (allkeys-*), -1 unknown (INFO and CONFIG not allowed)",
            redis_eviction_policy_ok.clone(),
        );
        registry.register(
            "redis_evicted_keys",
            "Keys the Redis primaries evicted since they started (INFO evicted_keys, summed); -1 unknown. A rise means data was evicted",
            redis_evicted_keys.clone(),
        );
        registry.register(
            "amqp_up",
            "1 while the AMQP connection is open",
            amqp_up.clone(),
        );
        let webhooks = WebhookMetrics::new(&mut registry);
        Self {
            webhooks,
            commands,
            invalid_commands,
            jobs_dispatched,
            jobs_expired,
            publish_retries,
            unroutable_returns,
            jobs_requeued,
            corrupt_records,
            publishes_in_flight,
            lateness,
            replication_shortfalls,
            replication_wait,
            redis_up,
            redis_oom,
            redis_acl_denied,
            redis_eviction_policy_ok,
            redis_evicted_keys,
            amqp_up,
            registry,
            topics: Mutex::new(BTreeMap::new()),
            stages_ready: AtomicU8::new(0),
        }
    }

    pub fn command(&self, op: &str, outcome: &str) {
        self.commands
            .get_or_create(&CommandLabels {
                op: op.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// A job of `topic` expired (set aside and released).
    pub fn expired(&self, topic: &str) {
        self.jobs_expired
            .get_or_create(&TopicLabels {
                topic: topic.into(),
            })
            .inc();
    }

    pub fn retry(&self, reason: &str) {
        self.publish_retries
            .get_or_create(&RetryLabels {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn replication_shortfall(&self, reason: &str) {
        self.replication_shortfalls
            .get_or_create(&ShortfallLabels {
                reason: reason.into(),
            })
            .inc();
    }

    /// Copies the store's view of Redis (the one source of truth, see
    /// `store::RedisHealth`) into the Redis gauges.
    pub fn set_redis_health(&self, health: &crate::store::HealthView) {
        self.redis_up.set(i64::from(health.reachable));
        self.redis_oom.set(i64::from(health.oom.is_some()));
        self.redis_acl_denied
            .set(i64::from(health.refused.is_some()));
        self.redis_eviction_policy_ok
            .set(health.eviction_policy_ok.map_or(-1, i64::from));
        self.redis_evicted_keys.set(
            health
                .evicted_keys
                .and_then(|n| i64::try_from(n).ok())
                .unwrap_or(-1),
        );
    }

    /// Marks one stage's AMQP connection as up (topology declared) or down.
    pub fn set_stage_ready(&self, stage: Stage, ready: bool) {
        let bit = stage as u8;
        let now = if ready {
            self.stages_ready.fetch_or(bit, Ordering::AcqRel) | bit
        } else {
            self.stages_ready.fetch_and(!bit, Ordering::AcqRel) & !bit
        };
        self.amqp_up.set(i64::from(now == Stage::ALL));
    }

    /// Marks every stage at once (for tests of the HTTP layer alone).
    pub fn set_topology_ready(&self, ready: bool) {
        for stage in [Stage::Ingest, Stage::Dispatch] {
            self.set_stage_ready(stage, ready);
        }
    }

    /// Every stage has its AMQP connection with the topology declared.
    pub fn topology_ready(&self) -> bool {
        self.stages_ready.load(Ordering::Acquire) == Stage::ALL
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::topics::TOPIC_GAUGES;
    use super::*;

    #[test]
    fn families_exist_before_first_use() {
        let text = Metrics::new().encode_as(Format::Classic);
        for reason in RETRY_REASONS {
            let line = format!("redisched_publish_retries_total{{reason=\"{reason}\"}} 0\n");
            assert!(text.contains(&line), "{line} missing in {text}");
        }
        for reason in SHORTFALL_REASONS {
            let line = format!("redisched_replication_shortfalls_total{{reason=\"{reason}\"}} 0\n");
            assert!(text.contains(&line), "{line} missing in {text}");
        }
        assert!(
            text.contains("# TYPE redisched_replication_wait_seconds histogram\n"),
            "{text}"
        );
        for (name, _, _) in TOPIC_GAUGES {
            assert!(
                text.contains(&format!("# TYPE {name} gauge\n")),
                "{name}: {text}"
            );
        }
    }
}

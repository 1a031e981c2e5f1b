//! Counters and gauges the bridge keeps, exported by `GET /metrics` in Prometheus
//! text format. Per-topic job counts are read from Redis at scrape time instead.

use std::sync::atomic::{AtomicU8, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommandLabels {
    /// `put`, `replace`, `delete`, or `invalid` when the op could not be read.
    pub op: String,
    /// `scheduled`, `replaced`, `duplicate`, `deleted`, `not_found`, `invalid`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// `nack`, `unroutable` or `error`.
    pub reason: String,
}

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

pub struct Metrics {
    pub commands: Family<CommandLabels, Counter>,
    pub invalid_commands: Counter,
    pub jobs_dispatched: Counter,
    pub publish_retries: Family<RetryLabels, Counter>,
    pub unroutable_returns: Counter,
    pub jobs_requeued: Counter,
    pub corrupt_records: Counter,
    pub publishes_in_flight: Gauge,
    pub lateness: Histogram,
    pub redis_up: Gauge,
    pub amqp_up: Gauge,
    registry: Registry,
    /// One bit per AMQP stage whose connection is open with the topology declared.
    stages_ready: AtomicU8,
}

impl Metrics {
    pub fn new() -> Self {
        let commands = Family::<CommandLabels, Counter>::default();
        let invalid_commands = Counter::default();
        let jobs_dispatched = Counter::default();
        let publish_retries = Family::<RetryLabels, Counter>::default();
        let unroutable_returns = Counter::default();
        let jobs_requeued = Counter::default();
        let corrupt_records = Counter::default();
        let publishes_in_flight = Gauge::default();
        // 1 ms .. ~65 s: precision matters at the low end.
        let lateness = Histogram::new([
            0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ]);
        let redis_up = Gauge::default();
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
        registry.register("redis_up", "1 while Redis answers", redis_up.clone());
        registry.register(
            "amqp_up",
            "1 while the AMQP connection is open",
            amqp_up.clone(),
        );
        Self {
            commands,
            invalid_commands,
            jobs_dispatched,
            publish_retries,
            unroutable_returns,
            jobs_requeued,
            corrupt_records,
            publishes_in_flight,
            lateness,
            redis_up,
            amqp_up,
            registry,
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

    pub fn retry(&self, reason: &str) {
        self.publish_retries
            .get_or_create(&RetryLabels {
                reason: reason.into(),
            })
            .inc();
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

    /// The registry in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

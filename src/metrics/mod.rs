//! Counters and gauges the bridge keeps, exported by `GET /metrics` in the classic
//! Prometheus text format (0.0.4) or in OpenMetrics, as the scraper asks ([`Format`]).
//! Per-topic gauges are a snapshot of what each topic holds now, read from Redis at
//! scrape time and handed over with [`Metrics::set_topics`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommandLabels {
    /// `put`, `replace`, `delete`, `delete-prefix`, or `unknown` when the op could not be
    /// read.
    pub op: String,
    /// `scheduled`, `replaced`, `duplicate`, `deleted`, `not_found`, `invalid`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabels {
    pub target: String,
    /// `2xx`, `4xx`, `5xx`, `timeout`, `connect`, `tls` (rarer: `1xx`, `3xx`, `url`, `error`).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TopicLabels {
    pub topic: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    pub target: String,
}

/// A webhook target's live state, as `GET /v1/targets` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TargetStatus {
    pub in_flight: u64,
    pub delivered: u64,
    pub failures: u64,
    /// Failures since the last 2xx: a failing target stands out.
    pub consecutive_failures: u64,
    /// `200`, `503`, `timeout`, ... of the latest attempt.
    pub last_status: Option<String>,
    pub last_error: Option<String>,
}

fn webhook_seconds() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

/// The webhook targets' metrics and live state.
#[derive(Debug)]
pub struct WebhookMetrics {
    pub requests: Family<WebhookLabels, Counter>,
    pub seconds: Family<TargetLabels, Histogram, fn() -> Histogram>,
    targets: Mutex<BTreeMap<String, TargetStatus>>,
}

impl WebhookMetrics {
    fn new(registry: &mut Registry) -> Self {
        let requests = Family::<WebhookLabels, Counter>::default();
        let seconds = Family::<TargetLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            webhook_seconds,
        );
        registry.register(
            "webhook_requests",
            "Webhook requests, by target and outcome code",
            requests.clone(),
        );
        registry.register(
            "webhook_request_seconds",
            "Webhook request duration, connect to last byte, by target",
            seconds.clone(),
        );
        Self {
            requests,
            seconds,
            targets: Mutex::new(BTreeMap::new()),
        }
    }

    fn with_status(&self, target: &str, change: impl FnOnce(&mut TargetStatus)) {
        let mut targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        change(targets.entry(target.to_owned()).or_default());
    }

    /// A request starts.
    pub fn started(&self, target: &str) {
        self.with_status(target, |s| s.in_flight += 1);
    }

    /// A request ended with `code` (`2xx`, `timeout`, ...); `status` the HTTP status
    /// or the code; `error` the failure's text.
    pub fn finished(
        &self,
        target: &str,
        code: &str,
        status: String,
        error: Option<String>,
        seconds: f64,
    ) {
        self.requests
            .get_or_create(&WebhookLabels {
                target: target.into(),
                code: code.into(),
            })
            .inc();
        self.seconds
            .get_or_create(&TargetLabels {
                target: target.into(),
            })
            .observe(seconds);
        self.with_status(target, |s| {
            s.in_flight = s.in_flight.saturating_sub(1);
            s.last_status = Some(status);
            if error.is_some() {
                s.failures += 1;
                s.consecutive_failures += 1;
                s.last_error = error;
            } else {
                s.delivered += 1;
                s.consecutive_failures = 0;
            }
        });
    }

    pub fn status(&self, target: &str) -> TargetStatus {
        let targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        targets.get(target).cloned().unwrap_or_default()
    }
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

/// What one topic holds now. A topic that holds nothing (all zero, not paused) has no
/// per-topic series at all, so drained topics do not keep series forever.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TopicSnapshot {
    /// Jobs waiting in the schedule, due or not.
    pub scheduled: u64,
    /// Scheduled jobs already due (the backlog).
    pub due: u64,
    /// Jobs handed to a dispatcher, not yet released.
    pub reserved: u64,
    /// Dispatch of the topic is paused.
    pub paused: bool,
    /// Jobs set aside after too many failed attempts, kept for an operator.
    pub parked: u64,
    /// Jobs whose last publish attempt failed and that wait for a retry.
    pub failing: u64,
    /// Due jobs the topic's rate limit holds back (counted in `due` too).
    pub throttled: u64,
}

impl TopicSnapshot {
    fn holds_something(&self) -> bool {
        self.paused || self.scheduled + self.reserved + self.parked + self.failing > 0
    }
}

/// One per-topic gauge family: name, help, and its value in a snapshot.
type TopicGauge = (&'static str, &'static str, fn(&TopicSnapshot) -> u64);

/// The per-topic gauge families. Always described (HELP/TYPE), with one sample per topic
/// that holds something.
const TOPIC_GAUGES: [TopicGauge; 7] = [
    (
        "redisched_jobs_scheduled",
        "Jobs waiting in the schedule, due or not.",
        |t| t.scheduled,
    ),
    (
        "redisched_jobs_due",
        "Scheduled jobs already due (the backlog).",
        |t| t.due,
    ),
    (
        "redisched_jobs_reserved",
        "Jobs handed to a dispatcher, not yet released.",
        |t| t.reserved,
    ),
    (
        "redisched_topic_paused",
        "1 while dispatch of the topic is paused.",
        |t| u64::from(t.paused),
    ),
    (
        "redisched_jobs_parked",
        "Jobs set aside after too many failed attempts.",
        |t| t.parked,
    ),
    (
        "redisched_jobs_failing",
        "Jobs whose last publish attempt failed, waiting for a retry.",
        |t| t.failing,
    ),
    (
        "redisched_jobs_throttled",
        "Due jobs the topic's rate limit holds back (all bridges together).",
        |t| t.throttled,
    ),
];

/// The exposition formats `GET /metrics` speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The classic Prometheus text format 0.0.4 (what `promtool check metrics` reads).
    Classic,
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
}

impl Format {
    /// Picks the format from an `Accept` header: OpenMetrics when the client asks for
    /// `application/openmetrics-text` at least as much as for plain text; the classic
    /// format otherwise, and when there is no header or it is unreadable.
    pub fn from_accept(accept: Option<&str>) -> Self {
        let (mut open_metrics, mut plain) = (0.0_f32, 0.0_f32);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let quality = parts
                .filter_map(|param| param.split_once('='))
                .find(|(key, _)| key.trim().eq_ignore_ascii_case("q"))
                .and_then(|(_, value)| value.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => open_metrics = open_metrics.max(quality),
                "text/plain" | "text/*" | "*/*" => plain = plain.max(quality),
                _ => {}
            }
        }
        if open_metrics > 0.0 && open_metrics >= plain {
            Format::OpenMetrics
        } else {
            Format::Classic
        }
    }

    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Classic => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

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

    /// Replaces the per-topic snapshot with `topics` (what each topic holds now). Topics
    /// left out, or holding nothing, lose their series. Pass nothing to drop every
    /// per-topic series (e.g. Redis did not answer).
    pub fn set_topics(&self, topics: impl IntoIterator<Item = (String, TopicSnapshot)>) {
        let fresh: BTreeMap<_, _> = topics
            .into_iter()
            .filter(|(_, snapshot)| snapshot.holds_something())
            .collect();
        *self
            .topics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = fresh;
    }

    /// Everything in OpenMetrics text.
    pub fn encode(&self) -> String {
        self.encode_as(Format::OpenMetrics)
    }

    /// Everything (the registry and the per-topic snapshot) in `format`.
    pub fn encode_as(&self, format: Format) -> String {
        let mut open_metrics = String::new();
        // Writing into a String cannot fail.
        prometheus_client::encoding::text::encode_registry(&mut open_metrics, &self.registry).ok();
        let mut out = match format {
            Format::OpenMetrics => open_metrics,
            Format::Classic => classic_from_open_metrics(&open_metrics),
        };
        self.encode_topics(&mut out);
        if format == Format::OpenMetrics {
            out.push_str("# EOF\n");
        }
        out
    }

    /// The per-topic gauges: the same lines in both formats (gauges have no suffix).
    fn encode_topics(&self, out: &mut String) {
        let topics = self
            .topics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Writing into a String cannot fail (`.ok()`).
        for (name, help, value) in TOPIC_GAUGES {
            writeln!(out, "# HELP {name} {help}").ok();
            writeln!(out, "# TYPE {name} gauge").ok();
            for (topic, snapshot) in topics.iter() {
                writeln!(
                    out,
                    "{name}{{topic=\"{}\"}} {}",
                    escape_label_value(topic),
                    value(snapshot)
                )
                .ok();
            }
        }
    }
}

/// Rewrites prometheus-client's OpenMetrics text (it writes no other text format) into
/// the classic format 0.0.4: there a counter's HELP and TYPE name its samples, which end
/// in `_total`; OpenMetrics names the family without the suffix. `# UNIT` and `# EOF`
/// have no classic counterpart. Samples are the same lines in both (no exemplars here).
fn classic_from_open_metrics(open_metrics: &str) -> String {
    let mut out = String::with_capacity(open_metrics.len() + 256);
    let mut help: Option<(&str, &str)> = None;
    for line in open_metrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = rest.split_once(' ');
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let Some((family, kind)) = rest.split_once(' ') else {
                continue;
            };
            let (name, kind) = match kind {
                "counter" => (format!("{family}_total"), "counter"),
                "info" => (format!("{family}_info"), "gauge"),
                "gauge" | "histogram" | "summary" => (family.to_string(), kind),
                _ => (family.to_string(), "untyped"),
            };
            if let Some((_, text)) = help.take().filter(|(named, _)| *named == family) {
                writeln!(out, "# HELP {name} {text}").ok();
            }
            writeln!(out, "# TYPE {name} {kind}").ok();
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A label value as both formats want it: backslash, double quote and newline escaped.
fn escape_label_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_picks_the_format() {
        let cases = [
            (None, Format::Classic),
            (Some(""), Format::Classic),
            (Some("*/*"), Format::Classic),
            (Some("text/plain;version=0.0.4"), Format::Classic),
            (Some("application/openmetrics-text"), Format::OpenMetrics),
            // What Prometheus itself sends.
            (
                Some("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
                Format::OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;q=0.3, text/plain"),
                Format::Classic,
            ),
            (Some("application/openmetrics-text;q=0"), Format::Classic),
            (Some("Application/OpenMetrics-Text; q=0.9"), Format::OpenMetrics),
            (Some("application/json"), Format::Classic),
        ];
        for (accept, want) in cases {
            assert_eq!(Format::from_accept(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn classic_names_counters_by_their_samples() {
        let metrics = Metrics::new();
        let classic = metrics.encode_as(Format::Classic);
        assert!(
            classic.contains("# HELP redisched_jobs_dispatched_total "),
            "{classic}"
        );
        assert!(
            classic.contains("# TYPE redisched_jobs_dispatched_total counter\n"),
            "{classic}"
        );
        assert!(
            classic.contains("redisched_jobs_dispatched_total 0\n"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"), "{classic}");
        let open = metrics.encode_as(Format::OpenMetrics);
        assert!(
            open.contains("# TYPE redisched_jobs_dispatched counter\n"),
            "{open}"
        );
        assert!(open.ends_with("# EOF\n"), "{open}");
    }

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

    #[test]
    fn only_topics_holding_something_have_series() {
        let metrics = Metrics::new();
        let busy = TopicSnapshot {
            scheduled: 3,
            due: 1,
            ..TopicSnapshot::default()
        };
        let paused = TopicSnapshot {
            paused: true,
            ..TopicSnapshot::default()
        };
        metrics.set_topics([
            ("busy".to_string(), busy),
            ("empty".to_string(), TopicSnapshot::default()),
            ("held".to_string(), paused),
        ]);
        let text = metrics.encode_as(Format::Classic);
        assert!(
            text.contains("redisched_jobs_scheduled{topic=\"busy\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("redisched_jobs_parked{topic=\"busy\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("redisched_topic_paused{topic=\"held\"} 1\n"),
            "{text}"
        );
        assert!(!text.contains("topic=\"empty\""), "{text}");

        metrics.set_topics([("busy".to_string(), TopicSnapshot::default())]);
        let text = metrics.encode_as(Format::Classic);
        assert!(!text.contains("topic="), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}

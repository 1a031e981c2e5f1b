//! Configuration: built-in defaults < a TOML file (`--config`) < `REDISCHED_*` env vars,
//! with `__` between nesting levels (`REDISCHED_DISPATCH__TTR_MS=60000`).
//!
//! Every value is checked at start; an error names the key so a typo fails fast
//! instead of surfacing as odd behaviour hours later.
//!
//! This file owns the schema (every section, its keys and their defaults), the error type
//! and what the rest of the crate asks of a loaded configuration. How it is loaded:
//! `load.rs`; how it is checked: `validate.rs`; how a child process gets it: `env.rs`.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::store::{ConnectOptions, Durability, Limits};
use crate::urls::redact_url;

mod env;
mod load;
mod validate;

pub use load::{foreign_env, foreign_env_names, ENV_PREFIX};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub redis: RedisConfig,
    pub amqp: AmqpConfig,
    pub limits: LimitsConfig,
    pub ingest: IngestConfig,
    pub dispatch: DispatchConfig,
    pub history: HistoryConfig,
    pub http: HttpConfig,
    pub log: LogConfig,
    pub telemetry: TelemetryConfig,
    /// Per-topic delivery policies, first match wins (`[[policies]]` in the file only:
    /// an array has no `REDISCHED_*` form).
    pub policies: Vec<PolicyConfig>,
    /// Webhook targets (`[[targets]]`, file only: `src/targets.rs`).
    pub targets: Vec<crate::targets::TargetConfig>,
}

/// One `[[policies]]` entry: which topics (AMQP topic patterns) and their default rate
/// limit. A live limit (`PUT /v1/topics/{topic}/rate-limit`, `redisched rate-limit`)
/// overrides it for its topic.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    pub topics: Vec<String>,
    /// Jobs per second at most (may be fractional, e.g. 0.5); absent = no limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_per_second: Option<f64>,
    /// Jobs at once after an idle spell (whole number >= 1); default 100 ms worth.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<f64>,
    /// Default expiry of the topics' jobs, ms after their due time: a job not delivered
    /// by then is set aside to the expired exchange (0 or absent = never). A job's own
    /// `x-redisched-expires-after` overrides it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_after_ms: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    pub url: String,
    /// Start of every key name; lets deployments (and tests) share one Redis.
    pub prefix: String,
    pub connect_timeout_ms: u64,
    pub response_timeout_ms: u64,
    /// PEM file of CAs trusted besides the system roots (`rediss://` only); empty = none.
    pub tls_ca_file: String,
    /// Replicas that must confirm a batch of commands (`WAIT`) before it is acked, and a
    /// job written over HTTP or the CLI before it is answered; 0 = no waiting.
    pub wait_replicas: u32,
    /// How long one `WAIT` blocks; when fewer replicas confirmed by then, the batch
    /// stays unacked (logged) and the wait is asked again.
    pub wait_timeout_ms: u64,
    /// Run although a Redis primary's `maxmemory-policy` may evict keys (`allkeys-*`),
    /// which could silently delete scheduled jobs; `false` refuses to start on one.
    pub allow_eviction: bool,
}

/// `http.max_connections` above this is beyond any file-descriptor limit.
pub const MAX_HTTP_CONNECTIONS: usize = 1_000_000;

/// `redis.wait_replicas` above this is a mistake, not a deployment: ingest would stall.
pub const MAX_WAIT_REPLICAS: u32 = 16;

/// Confirm channels per dispatch session at most: past a few, another channel only adds
/// broker processes competing for the same cores.
pub const MAX_DISPATCH_CHANNELS: usize = 16;

/// `amqp.command_partitions` above this is a mistake: every bridge holds a channel and
/// a consumer per partition.
pub const MAX_COMMAND_PARTITIONS: u16 = 256;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AmqpConfig {
    pub url: String,
    pub commands_exchange: String,
    pub commands_queue: String,
    pub invalid_exchange: String,
    pub invalid_queue: String,
    /// Jobs not delivered by due time + expires-after are set aside here (durable
    /// topic exchange, with a durable queue bound with `#`).
    pub expired_exchange: String,
    pub expired_queue: String,
    pub ready_exchange: String,
    /// One consumer at a time on the commands queue keeps commands in publish order
    /// across several bridges (a delete published after a put always wins).
    pub single_active_consumer: bool,
    /// Declare the commands and invalid queues as quorum queues (replicated, and able
    /// to dead-letter a poison command after `delivery_limit` deliveries).
    pub quorum_queues: bool,
    /// Deliveries of one command before the broker sets it aside to the invalid
    /// exchange (quorum queues only; 0 = unlimited).
    pub delivery_limit: u32,
    /// Command partitions: 1 (the default) is one commands queue; N > 1 feeds the
    /// route queue `<commands_queue>.route`, whose active consumer (the bridges' router)
    /// forwards each command by its job id to one of N queues `<commands_queue>.<k>`,
    /// each single-active-consumer: commands on one job still apply in publish order,
    /// and the partitions spread over the bridges (`docs/src/partitions.md`).
    pub command_partitions: u16,
    pub heartbeat_secs: u16,
    /// Backoff between reconnect attempts, doubling up to the max.
    pub reconnect_min_ms: u64,
    pub reconnect_max_ms: u64,
    /// PEM file of CAs trusted besides the system roots (`amqps://` only); empty = none.
    pub tls_ca_file: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Due times further than this from now are refused (never truncated).
    pub max_delay_ms: i64,
    pub max_body_bytes: usize,
    /// Shortest interval of a recurring job (`x-redisched-every`, `--every`).
    pub min_interval_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngestConfig {
    /// Unacked commands the broker may hand us at once.
    pub prefetch: u16,
    /// Commands applied to Redis in one pipelined round trip.
    pub batch: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DispatchConfig {
    /// Time-to-run of a reservation: a job not released by then is requeued.
    pub ttr_ms: u64,
    /// Jobs taken per reserve call.
    pub batch: usize,
    /// Publishes awaiting a broker confirm at most, over all the session's channels.
    pub window: usize,
    /// Confirm channels an AMQP dispatch session publishes on, taking turns per reserved
    /// batch: one channel is one broker process confirming in order, more let a busy
    /// broker confirm in parallel. Each channel keeps its own publish order.
    pub channels: usize,
    /// First retry delay after a nack or an unroutable return; doubles per attempt.
    pub retry_min_ms: u64,
    pub retry_max_ms: u64,
    /// How often expired reservations are looked for.
    pub requeue_interval_ms: u64,
    /// Longest sleep without news; a safety net under Pub/Sub wake-ups.
    pub poll_interval_ms: u64,
    /// How long shutdown waits for in-flight confirms.
    pub shutdown_grace_ms: u64,
    /// Failed publishes (unroutable, nack, channel error) of one job, or of one
    /// occurrence of a series, before it is parked until re-driven; 0 = retry forever.
    pub max_attempts: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HistoryConfig {
    /// Outcomes kept per topic (dispatched, deleted, replaced, parked, re-driven),
    /// newest first; 0 = write none.
    pub max_per_topic: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    pub enabled: bool,
    pub listen: String,
    /// Bearer token for every endpoint that changes or shows job data; empty = none
    /// (then the API is open, so only a loopback `listen` is allowed by default).
    pub token: String,
    /// A second token that may read (jobs, lists, history, the live feed, the dashboard's
    /// data) but change nothing; empty = none. Needs `token`.
    pub read_token: String,
    /// If set, `/metrics` needs this token (or `read_token`/`token`); empty = open.
    pub metrics_token: String,
    /// Permit a non-loopback listen address without a token.
    pub allow_public_without_token: bool,
    /// A connection that has not sent a whole request head this long after it opened (or
    /// after its previous response) is closed: slow or idle clients cannot hold a slot.
    pub header_read_timeout_ms: u64,
    /// Open connections at most (event streams included); further ones wait in the
    /// listen backlog until one closes.
    pub max_connections: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `human` or `json`.
    pub format: String,
    /// A tracing filter, e.g. `info` or `redisched=debug,lapin=warn`.
    pub level: String,
}

/// `[telemetry]`: OpenTelemetry traces exported over OTLP/HTTP (protobuf). Off unless an
/// endpoint is known: `otlp_endpoint`, else the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
/// or `OTEL_EXPORTER_OTLP_ENDPOINT` (`OTEL_SDK_DISABLED=true` turns it off whatever they
/// say). Off, no span is made and nothing is installed (src/telemetry/).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Base URL of an OTLP/HTTP receiver (`http://collector:4318`; `/v1/traces` is
    /// appended as for `OTEL_EXPORTER_OTLP_ENDPOINT`); empty = the standard variables, or off.
    pub otlp_endpoint: String,
    /// Share of new traces recorded, 0 to 1; a trace a producer started follows the
    /// producer's decision (parent-based).
    pub sampling_ratio: f64,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Finished spans waiting for export at most; more are dropped (never blocking a stage).
    pub max_queue_size: usize,
    /// How long a finished span waits for others before a batch is sent.
    pub batch_delay_ms: u64,
    /// One export request (and the flush at shutdown) gives up after this long.
    pub export_timeout_ms: u64,
}

/// `telemetry.max_queue_size` above this holds too many spans in memory to be meant.
pub const MAX_TELEMETRY_QUEUE: usize = 1 << 20;

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: String::new(),
            sampling_ratio: 1.0,
            service_name: "redisched".into(),
            max_queue_size: 2_048,
            batch_delay_ms: 5_000,
            export_timeout_ms: 10_000,
        }
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/0".into(),
            prefix: "redisched".into(),
            connect_timeout_ms: 5_000,
            response_timeout_ms: 5_000,
            tls_ca_file: String::new(),
            wait_replicas: 0,
            wait_timeout_ms: 1_000,
            allow_eviction: false,
        }
    }
}

impl Default for AmqpConfig {
    fn default() -> Self {
        Self {
            url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            commands_exchange: "redisched.commands".into(),
            commands_queue: "redisched.commands".into(),
            invalid_exchange: "redisched.invalid".into(),
            invalid_queue: "redisched.invalid".into(),
            expired_exchange: "redisched.expired".into(),
            expired_queue: "redisched.expired".into(),
            ready_exchange: "redisched.ready".into(),
            single_active_consumer: true,
            quorum_queues: true,
            delivery_limit: 5,
            command_partitions: 1,
            heartbeat_secs: 10,
            reconnect_min_ms: 200,
            reconnect_max_ms: 10_000,
            tls_ca_file: String::new(),
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_delay_ms: 366 * 24 * 3_600_000,
            max_body_bytes: 1 << 20,
            min_interval_ms: 1_000,
        }
    }
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            prefetch: 500,
            batch: 200,
        }
    }
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            ttr_ms: 30_000,
            batch: 200,
            window: 1_000,
            channels: 1,
            retry_min_ms: 1_000,
            retry_max_ms: 60_000,
            requeue_interval_ms: 1_000,
            poll_interval_ms: 1_000,
            shutdown_grace_ms: 10_000,
            max_attempts: 0,
        }
    }
}

impl Default for HistoryConfig {
    fn default() -> Self {
        Self {
            max_per_topic: crate::store::DEFAULT_HISTORY_MAX,
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: "127.0.0.1:7171".into(),
            token: String::new(),
            read_token: String::new(),
            metrics_token: String::new(),
            allow_public_without_token: false,
            header_read_timeout_ms: 10_000,
            max_connections: 1_024,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: "human".into(),
            // lapin logs every returned message, body included; ours says it once.
            level: "info,lapin::returned_messages=error".into(),
        }
    }
}

/// A configuration value that cannot work, named by its dotted key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
    /// A `[[targets]]` entry, keyed by index (`targets[1].url`).
    #[error("config key `{key}`: {message}")]
    Target { key: String, message: String },
}

impl Config {
    pub fn connect_options(&self) -> ConnectOptions {
        ConnectOptions {
            url: self.redis.url.clone(),
            prefix: self.redis.prefix.clone(),
            connect_timeout: Duration::from_millis(self.redis.connect_timeout_ms),
            response_timeout: Duration::from_millis(self.redis.response_timeout_ms),
            tls_ca_file: crate::tls::ca_file(&self.redis.tls_ca_file).map(Path::to_path_buf),
        }
    }

    /// What stores that answer for writes wait for (`redis.wait_replicas`); `None` = 0.
    pub fn durability(&self) -> Option<Durability> {
        (self.redis.wait_replicas > 0).then(|| Durability {
            replicas: self.redis.wait_replicas,
            timeout: Duration::from_millis(self.redis.wait_timeout_ms),
        })
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_delay_ms: self.limits.max_delay_ms,
            max_body_bytes: self.limits.max_body_bytes,
        }
    }

    /// A copy safe to print or log: passwords in URLs and the HTTP token are masked.
    pub fn redacted(&self) -> Config {
        let mut copy = self.clone();
        copy.redis.url = redact_url(&copy.redis.url);
        copy.amqp.url = redact_url(&copy.amqp.url);
        if !copy.telemetry.otlp_endpoint.is_empty() {
            copy.telemetry.otlp_endpoint = redact_url(&copy.telemetry.otlp_endpoint);
        }
        for target in &mut copy.targets {
            target.redact();
        }
        for token in [
            &mut copy.http.token,
            &mut copy.http.read_token,
            &mut copy.http.metrics_token,
        ] {
            if !token.is_empty() {
                *token = "***".into();
            }
        }
        copy
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use figment::providers::{Format, Toml};
    use figment::Figment;

    /// `config/default.toml` documents every key with its default: it must load, and
    /// say exactly what the built-in defaults say.
    #[test]
    fn shipped_default_file_matches_the_built_in_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default.toml");
        let from_file: Config = Figment::from(Toml::file_exact(&path))
            .extract()
            .expect("config/default.toml loads");
        assert_eq!(from_file, Config::default());
    }
}

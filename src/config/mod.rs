//! Configuration: built-in defaults < a TOML file (`--config`) < `REDISCHED_*` env vars,
//! with `__` between nesting levels (`REDISCHED_DISPATCH__TTR_MS=60000`).
//!
//! Every value is checked at start; an error names the key so a typo fails fast
//! instead of surfacing as odd behaviour hours later.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use crate::store::{ConnectOptions, Durability, Limits, MAX_BATCH};
use crate::urls::{amqp_urls, redact_url};

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
    /// Command partitions: 1 (the default) is one commands queue; N > 1 hashes each
    /// command's `message_id` onto N queues `<commands_queue>.<k>` through a
    /// consistent-hash exchange (the broker's `rabbitmq_consistent_hash_exchange`
    /// plugin), each single-active-consumer: commands on one job still apply in publish
    /// order, and the partitions spread over the bridges (README, *Order*).
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
    /// Publishes awaiting a broker confirm at most.
    pub window: usize,
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

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// Every configuration variable is `REDISCHED_<SECTION>__<KEY>`.
pub const ENV_PREFIX: &str = "REDISCHED_";
const ENV_NESTING: &str = "__";

/// Whether a variable name, without [`ENV_PREFIX`], has the `<SECTION>__<KEY>` shape of a
/// configuration variable. Only those are configuration, and they are checked strictly
/// (`REDISCHED_REDIS__ULR` fails, naming the key).
fn is_config_shaped(name: &str) -> bool {
    name.contains(ENV_NESTING)
}

/// `REDISCHED_*` variables of `vars` that are not configuration because they lack the
/// `<SECTION>__<KEY>` shape, sorted. Kubernetes injects `REDISCHED_PORT`,
/// `REDISCHED_SERVICE_HOST`, `REDISCHED_PORT_7171_TCP_ADDR`, ... into every pod of a
/// namespace that has a Service named `redisched`; they must not stop the bridge, so the
/// loader skips them and the binary names them in one warning.
pub fn foreign_env_names(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut names: Vec<String> = names
        .into_iter()
        .filter(|name| {
            name.get(..ENV_PREFIX.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(ENV_PREFIX))
                && !is_config_shaped(&name[ENV_PREFIX.len()..])
        })
        .collect();
    names.sort();
    names
}

/// [`foreign_env_names`] of this process's environment.
pub fn foreign_env() -> Vec<String> {
    foreign_env_names(std::env::vars_os().map(|(name, _)| name.to_string_lossy().into_owned()))
}

impl Config {
    /// Defaults, then `file` if given, then the environment; validated.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::from_figment(Self::figment(file))
    }

    pub fn figment(file: Option<&Path>) -> Figment {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            figment = figment.merge(Toml::file_exact(path));
        }
        figment.merge(
            Env::prefixed(ENV_PREFIX)
                .filter(|key| is_config_shaped(key.as_str()))
                .split(ENV_NESTING),
        )
    }

    pub fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let config: Config = figment.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every key; the first bad one is named in the error, in the schema's order
    /// (Redis, AMQP, limits, ingest and dispatch, HTTP, log, policies, TLS, targets).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_redis()?;
        self.validate_amqp()?;
        self.validate_stages()?;
        self.validate_http()?;
        if !matches!(self.log.format.as_str(), "human" | "json") {
            return Err(invalid("log.format", "must be `human` or `json`"));
        }
        tracing_subscriber::EnvFilter::try_new(&self.log.level)
            .map_err(|e| invalid("log.level", e.to_string()))?;
        self.compiled_policies()?;
        self.validate_tls()?;
        crate::targets::validate(&self.targets, self.dispatch.ttr_ms).map_err(|e| {
            ConfigError::Target {
                key: e.key,
                message: e.message,
            }
        })
    }

    fn validate_redis(&self) -> Result<(), ConfigError> {
        let standalone_ok = |url: &str| {
            url::Url::parse(url)
                .ok()
                .is_some_and(|u| matches!(u.scheme(), "redis" | "rediss" | "redis+unix" | "unix"))
        };
        let redis_ok = match crate::store::cluster_seeds(&self.redis.url) {
            Some(seeds) => !seeds.is_empty() && seeds.iter().all(|s| standalone_ok(s)),
            None => standalone_ok(&self.redis.url),
        };
        if !redis_ok {
            return Err(invalid(
                "redis.url",
                "expected redis://host:port/db or redis-cluster://host:port,host:port",
            ));
        }
        if self.redis.prefix.is_empty() || self.redis.prefix.contains(['{', '}']) {
            return Err(invalid(
                "redis.prefix",
                "must be non-empty and free of braces",
            ));
        }
        self.validate_wait()
    }

    fn validate_amqp(&self) -> Result<(), ConfigError> {
        // One URL, or several (the nodes of a cluster) separated by commas: each must be
        // an amqp:// or amqps:// URL.
        let amqp_ok = |url: &str| {
            url::Url::parse(url)
                .ok()
                .is_some_and(|u| matches!(u.scheme(), "amqp" | "amqps"))
        };
        let amqp = amqp_urls(&self.amqp.url);
        if amqp.is_empty() || !amqp.iter().all(|u| amqp_ok(u)) {
            return Err(invalid(
                "amqp.url",
                "expected amqp://user:pass@host:port/vhost, or several separated by commas",
            ));
        }
        for (key, name) in [
            ("amqp.commands_exchange", &self.amqp.commands_exchange),
            ("amqp.commands_queue", &self.amqp.commands_queue),
            ("amqp.invalid_exchange", &self.amqp.invalid_exchange),
            ("amqp.invalid_queue", &self.amqp.invalid_queue),
            ("amqp.expired_exchange", &self.amqp.expired_exchange),
            ("amqp.expired_queue", &self.amqp.expired_queue),
            ("amqp.ready_exchange", &self.amqp.ready_exchange),
        ] {
            if name.is_empty() || name.len() > 255 {
                return Err(invalid(key, "must be 1..255 bytes"));
            }
        }
        if !(1..=MAX_COMMAND_PARTITIONS).contains(&self.amqp.command_partitions) {
            return Err(invalid(
                "amqp.command_partitions",
                format!("must be 1..={MAX_COMMAND_PARTITIONS} (1 = one commands queue)"),
            ));
        }
        if self.amqp.command_partitions > 1 && !self.amqp.single_active_consumer {
            return Err(invalid(
                "amqp.command_partitions",
                "partitions keep a job's commands in order only with amqp.single_active_consumer = true",
            ));
        }
        if self.amqp.reconnect_min_ms == 0
            || self.amqp.reconnect_max_ms < self.amqp.reconnect_min_ms
        {
            return Err(invalid(
                "amqp.reconnect_max_ms",
                "must be >= amqp.reconnect_min_ms > 0",
            ));
        }
        if self.amqp.heartbeat_secs == 0 {
            // 0 would negotiate no heartbeats at all: a half-open broker connection
            // (a cut the kernel never reports) would then hang a stage for good.
            return Err(invalid(
                "amqp.heartbeat_secs",
                "must be > 0: heartbeats are how a half-open broker connection is noticed",
            ));
        }
        Ok(())
    }

    /// `limits`, `ingest` and `dispatch`.
    fn validate_stages(&self) -> Result<(), ConfigError> {
        if self.limits.max_delay_ms <= 0 {
            return Err(invalid("limits.max_delay_ms", "must be > 0"));
        }
        if self.limits.max_body_bytes == 0 || self.limits.max_body_bytes > 512 << 20 {
            return Err(invalid("limits.max_body_bytes", "must be 1..=512 MiB"));
        }
        if self.limits.min_interval_ms == 0 {
            return Err(invalid("limits.min_interval_ms", "must be > 0"));
        }
        if self.ingest.prefetch == 0 {
            return Err(invalid("ingest.prefetch", "must be > 0"));
        }
        if !(1..=MAX_BATCH).contains(&self.ingest.batch) {
            return Err(invalid("ingest.batch", format!("must be 1..={MAX_BATCH}")));
        }
        if self.dispatch.ttr_ms < 100 {
            return Err(invalid("dispatch.ttr_ms", "must be >= 100"));
        }
        if !(1..=MAX_BATCH).contains(&self.dispatch.batch) {
            return Err(invalid(
                "dispatch.batch",
                format!("must be 1..={MAX_BATCH}"),
            ));
        }
        if self.dispatch.window == 0 {
            return Err(invalid("dispatch.window", "must be > 0"));
        }
        if self.dispatch.retry_min_ms == 0
            || self.dispatch.retry_max_ms < self.dispatch.retry_min_ms
        {
            return Err(invalid(
                "dispatch.retry_max_ms",
                "must be >= dispatch.retry_min_ms > 0",
            ));
        }
        for (key, value) in [
            (
                "dispatch.requeue_interval_ms",
                self.dispatch.requeue_interval_ms,
            ),
            ("dispatch.poll_interval_ms", self.dispatch.poll_interval_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be > 0"));
            }
        }
        Ok(())
    }

    fn validate_http(&self) -> Result<(), ConfigError> {
        let listen: SocketAddr = self
            .http
            .listen
            .parse()
            .map_err(|e| invalid("http.listen", format!("expected ip:port ({e})")))?;
        if self.http.enabled
            && !listen.ip().is_loopback()
            && self.http.token.is_empty()
            && !self.http.allow_public_without_token
        {
            return Err(invalid(
                "http.listen",
                "a non-loopback address needs http.token (or http.allow_public_without_token = true)",
            ));
        }
        if !self.http.read_token.is_empty() && self.http.token.is_empty() {
            return Err(invalid(
                "http.read_token",
                "needs http.token: without it the API is open and a read-only token guards nothing",
            ));
        }
        if !self.http.read_token.is_empty() && self.http.read_token == self.http.token {
            return Err(invalid(
                "http.read_token",
                "must differ from http.token, or it would grant writes",
            ));
        }
        if self.http.header_read_timeout_ms == 0 {
            return Err(invalid("http.header_read_timeout_ms", "must be > 0"));
        }
        if !(1..=MAX_HTTP_CONNECTIONS).contains(&self.http.max_connections) {
            return Err(invalid(
                "http.max_connections",
                format!("must be 1..={MAX_HTTP_CONNECTIONS}"),
            ));
        }
        Ok(())
    }

    /// `[[policies]]` compiled (patterns parsed, limits checked); an error names the
    /// entry's key, e.g. `policies[1].max_per_second`.
    pub fn compiled_policies(&self) -> Result<crate::policy::Policies, ConfigError> {
        use crate::policy::{Policy, RateLimit, TopicPattern};
        let mut compiled = Vec::with_capacity(self.policies.len());
        for (i, policy) in self.policies.iter().enumerate() {
            if policy.topics.is_empty() {
                return Err(invalid(
                    format!("policies[{i}].topics"),
                    "must list at least one topic pattern (e.g. [\"mail.*\"])",
                ));
            }
            let topics = policy
                .topics
                .iter()
                .map(|p| TopicPattern::new(p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(format!("policies[{i}].topics"), e))?;
            let rate = match policy.max_per_second {
                None if policy.burst.is_some() => {
                    return Err(invalid(
                        format!("policies[{i}].burst"),
                        "needs max_per_second",
                    ))
                }
                None => None,
                Some(rate) => Some(RateLimit::new(rate, policy.burst).map_err(|e| {
                    let field = if e.0.starts_with("burst") {
                        "burst"
                    } else {
                        "max_per_second"
                    };
                    invalid(format!("policies[{i}].{field}"), e.0)
                })?),
            };
            let expires_after_ms = match policy.expires_after_ms {
                None => 0,
                Some(ms) => crate::policy::check_expires_after("expires_after_ms", i128::from(ms))
                    .map_err(|e| invalid(format!("policies[{i}].expires_after_ms"), e.0))?,
            };
            compiled.push(Policy {
                topics,
                rate,
                expires_after_ms,
            });
        }
        Ok(crate::policy::Policies(compiled))
    }

    /// `redis.wait_replicas` and `redis.wait_timeout_ms`.
    fn validate_wait(&self) -> Result<(), ConfigError> {
        let redis = &self.redis;
        if redis.wait_replicas > MAX_WAIT_REPLICAS {
            return Err(invalid(
                "redis.wait_replicas",
                format!(
                    "must be 0..={MAX_WAIT_REPLICAS} (replicas that confirm each write; 0 = no waiting)"
                ),
            ));
        }
        if redis.wait_timeout_ms == 0 {
            return Err(invalid(
                "redis.wait_timeout_ms",
                "must be > 0 (Redis reads a WAIT timeout of 0 as \"wait forever\")",
            ));
        }
        // The WAIT travels in the same pipeline as the writes, under the response timeout:
        // a longer WAIT would be taken for a dead connection.
        if redis.wait_replicas > 0 && redis.wait_timeout_ms >= redis.response_timeout_ms {
            return Err(invalid(
                "redis.wait_timeout_ms",
                format!(
                    "must be below redis.response_timeout_ms ({} ms): a longer wait would count as a dead connection",
                    redis.response_timeout_ms
                ),
            ));
        }
        Ok(())
    }

    /// The TLS part of the config check: TLS URLs need the feature, a CA file needs a TLS
    /// URL to apply to (a CA file next to a plaintext URL would look protected and not
    /// be), and it must hold at least one PEM certificate.
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let redis_tls = self.redis.url.starts_with("rediss://");
        let amqp_tls = self
            .amqp
            .url
            .split(',')
            .any(|u| u.trim().starts_with("amqps://"));
        for (key, tls, scheme) in [
            ("redis.url", redis_tls, "rediss://"),
            ("amqp.url", amqp_tls, "amqps://"),
        ] {
            if tls && !crate::tls::ENABLED {
                return Err(invalid(
                    key,
                    format!(
                        "{scheme} needs TLS, and this build has none (built without the `tls` feature)"
                    ),
                ));
            }
        }
        for (key, file, tls, scheme) in [
            (
                "redis.tls_ca_file",
                &self.redis.tls_ca_file,
                redis_tls,
                "rediss://",
            ),
            (
                "amqp.tls_ca_file",
                &self.amqp.tls_ca_file,
                amqp_tls,
                "amqps://",
            ),
        ] {
            let Some(path) = crate::tls::ca_file(file) else {
                continue;
            };
            if !tls {
                return Err(invalid(
                    key,
                    format!("only used with a {scheme} URL: use one, or leave this key empty"),
                ));
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))?;
            if !text.contains(crate::tls::PEM_CERTIFICATE) {
                return Err(invalid(
                    key,
                    format!("{} holds no PEM certificate", path.display()),
                ));
            }
        }
        Ok(())
    }

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

    /// The `REDISCHED_*` environment that reproduces this configuration, every key
    /// (`REDISCHED_DISPATCH__TTR_MS=30000`): how tests and benchmarks start a
    /// `redisched run` child with a configuration built in code.
    pub fn to_env(&self) -> Vec<(String, String)> {
        let mut vars = Vec::new();
        if let Ok(serde_json::Value::Object(sections)) = serde_json::to_value(self) {
            for (section, keys) in sections {
                let serde_json::Value::Object(keys) = keys else {
                    continue;
                };
                for (key, value) in keys {
                    let value = match value {
                        serde_json::Value::String(text) => text,
                        other => other.to_string(),
                    };
                    let name = format!("REDISCHED_{}__{}", section, key).to_uppercase();
                    vars.push((name, value));
                }
            }
        }
        vars
    }

    /// A copy safe to print or log: passwords in URLs and the HTTP token are masked.
    pub fn redacted(&self) -> Config {
        let mut copy = self.clone();
        copy.redis.url = redact_url(&copy.redis.url);
        copy.amqp.url = redact_url(&copy.amqp.url);
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

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn env_overrides_file_overrides_defaults_and_bad_values_name_their_key() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "[dispatch]\nttr_ms = 5000\nbatch = 10\n")?;
            jail.set_env("REDISCHED_DISPATCH__TTR_MS", "7000");
            jail.set_env("REDISCHED_REDIS__URL", "redis://127.0.0.1:6390/2");
            jail.set_env("REDISCHED_AMQP__URL", "amqp://u:p@h:5673/v");
            let config = Config::load(Some(Path::new("c.toml"))).expect("valid");
            assert_eq!(config.dispatch.ttr_ms, 7000);
            assert_eq!(config.dispatch.batch, 10);
            assert_eq!(config.redis.url, "redis://127.0.0.1:6390/2");
            assert_eq!(config.amqp.url, "amqp://u:p@h:5673/v");

            jail.set_env("REDISCHED_DISPATCH__TTR_MS", "5");
            let err = Config::load(None).expect_err("ttr too small");
            assert!(err.to_string().contains("dispatch.ttr_ms"), "{err}");
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn kubernetes_service_variables_are_skipped_but_typos_in_a_section_still_fail() {
        figment::Jail::expect_with(|jail| {
            // What Kubernetes injects for a Service named `redisched` (port 7171, named `http`).
            let injected = [
                ("REDISCHED_PORT", "tcp://10.96.0.12:7171"),
                ("REDISCHED_SERVICE_HOST", "10.96.0.12"),
                ("REDISCHED_SERVICE_PORT", "7171"),
                ("REDISCHED_SERVICE_PORT_HTTP", "7171"),
                ("REDISCHED_PORT_7171_TCP", "tcp://10.96.0.12:7171"),
                ("REDISCHED_PORT_7171_TCP_ADDR", "10.96.0.12"),
                ("REDISCHED_PORT_7171_TCP_PORT", "7171"),
                ("REDISCHED_PORT_7171_TCP_PROTO", "tcp"),
            ];
            for (name, value) in injected {
                jail.set_env(name, value);
            }
            jail.set_env("REDISCHED_DISPATCH__TTR_MS", "7000");
            let config = Config::load(None).expect("service variables do not stop the loader");
            assert_eq!(config.dispatch.ttr_ms, 7000);

            let names = foreign_env_names(
                injected
                    .iter()
                    .map(|(name, _)| name.to_string())
                    .chain(["REDISCHED_DISPATCH__TTR_MS".into(), "PATH".into()]),
            );
            let mut expected: Vec<String> = injected.iter().map(|(n, _)| n.to_string()).collect();
            expected.sort();
            assert_eq!(names, expected);

            jail.set_env("REDISCHED_REDIS__ULR", "redis://127.0.0.1:6379");
            let err = Config::load(None).expect_err("a misspelled key in a known section");
            assert!(err.to_string().contains("ulr"), "{err}");
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn to_env_reproduces_the_configuration_through_the_loader() {
        let mut config = Config::default();
        config.redis.prefix = "p-1".into();
        config.amqp.url = "amqp://u:p@h1:5672/%2f,amqp://u:p@h2:5672/%2f".into();
        config.dispatch.ttr_ms = 1234;
        config.http.enabled = false;
        config.log.level = "info,lapin=warn".into();
        figment::Jail::expect_with(|jail| {
            for (name, value) in config.to_env() {
                jail.set_env(name, value);
            }
            assert_eq!(Config::load(None).expect("loads"), config);
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's signature, not ours
    fn policies_load_from_the_file_and_bad_ones_name_their_key() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "p.toml",
                "[[policies]]\ntopics = [\"mail.*\"]\nmax_per_second = 0.5\n\n[[policies]]\ntopics = [\"#\"]\nmax_per_second = 200\nburst = 5\n",
            )?;
            let config = Config::load(Some(Path::new("p.toml"))).expect("valid");
            let policies = config.compiled_policies().expect("compiles");
            let t = |s| crate::job::Topic::new(s).unwrap();
            let rate = policies.rate_for(&t("mail.x")).expect("first");
            assert_eq!((rate.max_per_second, rate.burst), (0.5, 1));
            let rate = policies.rate_for(&t("sms")).expect("second");
            assert_eq!((rate.max_per_second, rate.burst), (200.0, 5));
            assert_eq!(policies.expires_after_for(&t("sms")), 0);
            jail.create_file(
                "e.toml",
                "[[policies]]\ntopics = [\"mail.#\"]\nexpires_after_ms = 60000\n",
            )?;
            let config = Config::load(Some(Path::new("e.toml"))).expect("valid");
            let policies = config.compiled_policies().expect("compiles");
            assert_eq!(policies.expires_after_for(&t("mail.x")), 60_000);
            assert_eq!(policies.rate_for(&t("mail.x")), None);
            for (body, key, needle) in [
                ("max_per_second = 0", "policies[0].max_per_second", "pause"),
                ("max_per_second = -2", "policies[0].max_per_second", "> 0"),
                (
                    "max_per_second = 1e12",
                    "policies[0].max_per_second",
                    "0.001..=",
                ),
                (
                    "max_per_second = 5\nburst = 0",
                    "policies[0].burst",
                    "whole number",
                ),
                (
                    "max_per_second = 5\nburst = 2.5",
                    "policies[0].burst",
                    "whole number",
                ),
                ("burst = 2", "policies[0].burst", "needs max_per_second"),
                (
                    "expires_after_ms = -1",
                    "policies[0].expires_after_ms",
                    ">= 0",
                ),
                ("expires_after_ms = \"soon\"", "expires_after_ms", ""),
            ] {
                jail.create_file(
                    "bad.toml",
                    &format!("[[policies]]\ntopics = [\"a\"]\n{body}\n"),
                )?;
                let err = Config::load(Some(Path::new("bad.toml"))).expect_err(body);
                assert!(
                    err.to_string().contains(key) && err.to_string().contains(needle),
                    "{body}: {err}"
                );
            }
            jail.create_file(
                "bad.toml",
                "[[policies]]\ntopics = [\"a.b*\"]\nmax_per_second = 1\n",
            )?;
            let err = Config::load(Some(Path::new("bad.toml"))).expect_err("pattern");
            assert!(err.to_string().contains("policies[0].topics"), "{err}");
            jail.create_file(
                "bad.toml",
                "[[policies]]\ntopics = [\"a\"]\nmax_per_second = \"fast\"\n",
            )?;
            let err = Config::load(Some(Path::new("bad.toml"))).expect_err("not a number");
            assert!(err.to_string().contains("max_per_second"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn heartbeats_cannot_be_turned_off() {
        let mut config = Config::default();
        config.amqp.heartbeat_secs = 0;
        let err = config.validate().expect_err("refused");
        assert!(err.to_string().contains("amqp.heartbeat_secs"), "{err}");
        assert!(err.to_string().contains("half-open"), "{err}");
    }

    #[test]
    fn command_partitions_are_1_to_256_and_need_a_single_active_consumer() {
        for bad in [0, MAX_COMMAND_PARTITIONS + 1] {
            let mut config = Config::default();
            config.amqp.command_partitions = bad;
            let err = config.validate().expect_err("refused");
            assert!(err.to_string().contains("amqp.command_partitions"), "{err}");
        }
        let mut config = Config::default();
        config.amqp.command_partitions = 8;
        assert!(config.validate().is_ok());
        config.amqp.single_active_consumer = false;
        let err = config.validate().expect_err("refused");
        assert!(err.to_string().contains("single_active_consumer"), "{err}");
        config.amqp.command_partitions = 1;
        assert!(config.validate().is_ok());
    }

    #[test]
    fn public_listen_without_token_is_refused() {
        let mut config = Config::default();
        config.http.listen = "0.0.0.0:7171".into();
        let err = config.validate().expect_err("refused");
        assert!(err.to_string().contains("http.listen"), "{err}");
        config.http.token = "t".into();
        config.validate().expect("a token makes it fine");
    }

    #[test]
    fn http_connection_limits_are_checked_in_user_terms() {
        for (key, set) in [
            (
                "http.header_read_timeout_ms",
                (|c: &mut Config| c.http.header_read_timeout_ms = 0) as fn(&mut Config),
            ),
            ("http.max_connections", |c: &mut Config| {
                c.http.max_connections = 0
            }),
            ("http.max_connections", |c: &mut Config| {
                c.http.max_connections = MAX_HTTP_CONNECTIONS + 1
            }),
        ] {
            let mut config = Config::default();
            set(&mut config);
            let err = config.validate().unwrap_err();
            assert!(err.to_string().contains(key), "{err}");
        }
        assert!(Config::default().validate().is_ok());
    }

    #[test]
    fn wait_settings_are_checked_in_user_terms() {
        let mut config = Config::default();
        assert_eq!(config.durability(), None, "0 replicas: no waiting at all");
        config.redis.wait_replicas = 1;
        assert_eq!(
            config.durability(),
            Some(Durability {
                replicas: 1,
                timeout: Duration::from_secs(1)
            })
        );
        config.validate().expect("1 replica, 1 s");

        config.redis.wait_timeout_ms = 0;
        let err = config.validate().expect_err("0 would wait forever");
        assert!(
            err.to_string().contains("redis.wait_timeout_ms")
                && err.to_string().contains("forever"),
            "{err}"
        );
        config.redis.wait_timeout_ms = 5_000;
        let err = config
            .validate()
            .expect_err("as long as the response timeout");
        assert!(
            err.to_string()
                .contains("below redis.response_timeout_ms (5000 ms)"),
            "{err}"
        );
        config.redis.response_timeout_ms = 10_000;
        config
            .validate()
            .expect("a longer response timeout makes room");

        config.redis.wait_replicas = 100;
        let err = config.validate().expect_err("absurd replica count");
        assert!(
            err.to_string().contains("redis.wait_replicas") && err.to_string().contains("0..=16"),
            "{err}"
        );
        // Without waiting, the timeout only has to be a usable number.
        config.redis.wait_replicas = 0;
        config.redis.response_timeout_ms = 1_000;
        config
            .validate()
            .expect("unused timeout above the response timeout");
    }

    #[test]
    fn several_amqp_urls_are_validated() {
        let list = "amqp://guest:s1@h1:5672/%2f, amqp://u:s2@h2:5673/v,amqps://h3/%2f";
        let mut config = Config::default();
        config.amqp.url = list.into();
        config.validate().expect("a list of amqp URLs is valid");
        config.amqp.url = "amqp://h1/%2f,redis://h2".into();
        let err = config.validate().expect_err("every part must be amqp");
        assert!(err.to_string().contains("amqp.url"), "{err}");
        config.amqp.url = " , ".into();
        config.validate().expect_err("no URL at all");
    }
}

#[cfg(test)]
mod shipped_file_tests {
    use super::*;

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

    #[test]
    fn a_ca_file_needs_a_tls_url_and_a_certificate() {
        let dir = std::env::temp_dir().join(format!("redisched-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pem = dir.join("ca.pem");
        std::fs::write(
            &pem,
            format!(
                "{}\nAAAA\n-----END CERTIFICATE-----\n",
                crate::tls::PEM_CERTIFICATE
            ),
        )
        .unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();

        let mut config = Config::default();
        config.validate().expect("defaults are valid");
        config.redis.tls_ca_file = pem.display().to_string();
        let err = config.validate().expect_err("redis:// with a CA file");
        assert!(err.to_string().contains("redis.tls_ca_file"), "{err}");
        config.redis.url = "rediss://127.0.0.1:6380/0".into();
        if crate::tls::ENABLED {
            config.validate().expect("rediss:// with a CA file");
        } else {
            let err = config.validate().expect_err("no TLS in this build");
            assert!(err.to_string().contains("redis.url"), "{err}");
            return;
        }
        config.redis.tls_ca_file = junk.display().to_string();
        let err = config.validate().expect_err("no certificate in it");
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
        config.redis.tls_ca_file = dir.join("missing.pem").display().to_string();
        let err = config.validate().expect_err("missing file");
        assert!(err.to_string().contains("cannot read"), "{err}");
        config.redis.tls_ca_file = String::new();

        config.amqp.tls_ca_file = pem.display().to_string();
        let err = config.validate().expect_err("amqp:// with a CA file");
        assert!(err.to_string().contains("amqp.tls_ca_file"), "{err}");
        config.amqp.url = "amqps://guest:guest@127.0.0.1:5671/%2f".into();
        config.validate().expect("amqps:// with a CA file");
        std::fs::remove_dir_all(&dir).ok();
    }
}

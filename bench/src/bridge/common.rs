//! Shared by the bridge scenarios: unique names, a child `redisched run`, lapin
//! publishers and consumers, cleanup, progress lines and percentiles.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::{stream, StreamExt};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use redisched::config::Config;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{Op, PutRequest, Store};
use redisched_testkit::ChildBridge;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

/// Where the services are and which bridge binary to run.
#[derive(Clone, Debug)]
pub(crate) struct Env {
    pub redis_url: String,
    pub amqp_url: String,
    pub bridge_bin: PathBuf,
    /// `--bridge-set` keys: (section, key, value).
    pub bridge_set: Vec<(String, String, Value)>,
}

impl Env {
    /// The bridge binary defaults to `redisched` beside this executable (same profile).
    pub(crate) fn new(
        redis_url: String,
        amqp_url: String,
        bridge_bin: Option<PathBuf>,
        bridge_set: &[String],
    ) -> Result<Self> {
        let bridge_bin = match bridge_bin {
            Some(path) => path,
            None => std::env::current_exe()
                .context("locate the bench executable")?
                .with_file_name("redisched"),
        };
        if !bridge_bin.exists() {
            bail!(
                "bridge binary {} not found: build it first (cargo build --release --bin redisched) or pass --bridge-bin",
                bridge_bin.display()
            );
        }
        let mut sets = Vec::new();
        for set in bridge_set {
            let (path, value) = set
                .split_once('=')
                .with_context(|| format!("--bridge-set {set}: expected section.key=value"))?;
            let (section, key) = path
                .split_once('.')
                .with_context(|| format!("--bridge-set {set}: expected section.key=value"))?;
            let value =
                serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
            sets.push((section.to_string(), key.to_string(), value));
        }
        let env = Self {
            redis_url,
            amqp_url,
            bridge_bin,
            bridge_set: sets,
        };
        // Refused now, not in the middle of a run.
        env.with_bridge_set(Config::default())?;
        Ok(env)
    }

    /// `config` with the `--bridge-set` keys applied; an unknown key or a bad value is
    /// an error naming it.
    pub(crate) fn with_bridge_set(&self, config: Config) -> Result<Config> {
        if self.bridge_set.is_empty() {
            return Ok(config);
        }
        let mut tree = serde_json::to_value(&config)?;
        for (section, key, value) in &self.bridge_set {
            let slot = tree
                .get_mut(section.as_str())
                .and_then(|s| s.as_object_mut())
                .and_then(|s| s.get_mut(key.as_str()))
                .with_context(|| format!("--bridge-set: no configuration key {section}.{key}"))?;
            *slot = value.clone();
        }
        let config: Config = serde_json::from_value(tree).context("--bridge-set")?;
        config
            .validate()
            .map_err(|err| anyhow::anyhow!("--bridge-set: {err}"))?;
        Ok(config)
    }
}

/// A name no other run uses: `bench-<label>-<pid>-<time>-<n>`.
pub(crate) fn unique(label: &str) -> String {
    redisched_testkit::unique(&format!("bench-{label}"))
}

/// Production defaults with every name unique to this scenario and HTTP off.
pub(crate) fn bench_config(env: &Env, label: &str) -> Config {
    let mut config = Config::default();
    redisched_testkit::isolate(&mut config, &unique(label));
    config.redis.url = env.redis_url.clone();
    config.amqp.url = env.amqp_url.clone();
    config.http.enabled = false;
    // The bench's own progress lines are what matter on stderr.
    config.log.level = "warn".into();
    config
}

/// A `redisched run` child process; killed on drop if still running.
pub(crate) struct Bridge {
    process: ChildBridge,
    pub started: Instant,
}

/// The `REDISCHED_*` variables of `config` that differ from the defaults. Naming only
/// what a run changed lets it start an older `redisched` (compare's baseline), whose
/// strict loader refuses keys it does not know.
fn changed_env(config: &Config) -> Vec<(String, String)> {
    let defaults: std::collections::HashSet<(String, String)> =
        Config::default().to_env().into_iter().collect();
    config
        .to_env()
        .into_iter()
        .filter(|var| !defaults.contains(var))
        .collect()
}

impl Bridge {
    pub(crate) fn start(env: &Env, config: &Config) -> Result<Self> {
        let config = env.with_bridge_set(config.clone())?;
        let child = std::process::Command::new(&env.bridge_bin)
            .arg("run")
            .envs(changed_env(&config))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawn {} run", env.bridge_bin.display()))?;
        Ok(Self {
            process: ChildBridge { child },
            started: Instant::now(),
        })
    }

    /// As [`Bridge::start`], with `--config file` too: for what has no env form
    /// (`[[targets]]`); the env still overrides the file.
    pub(crate) fn start_with_file(
        env: &Env,
        config: &Config,
        file: &std::path::Path,
    ) -> Result<Self> {
        let child = std::process::Command::new(&env.bridge_bin)
            .arg("--config")
            .arg(file)
            .arg("run")
            .envs(changed_env(config))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!(
                    "spawn {} --config {} run",
                    env.bridge_bin.display(),
                    file.display()
                )
            })?;
        Ok(Self {
            process: ChildBridge { child },
            started: Instant::now(),
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Resident set size in KiB (`VmRSS` of /proc/<pid>/status).
    pub(crate) fn rss_kib(&self) -> Option<u64> {
        rss_kib(self.pid())
    }

    /// User + system CPU seconds the bridge used so far (/proc/<pid>/stat).
    pub(crate) fn cpu_seconds(&self) -> Option<f64> {
        cpu_seconds(self.pid())
    }

    /// Fails if the bridge exited early (bad config, cannot connect…).
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.process.child.try_wait()? {
            bail!("the bridge exited early: {status}");
        }
        Ok(())
    }

    /// SIGTERM, then wait (graceful stop).
    pub(crate) fn stop(mut self) -> Result<()> {
        match self.process.terminate(Duration::from_secs(20))? {
            Some(_) => Ok(()),
            None => bail!("the bridge did not stop within 20 s of SIGTERM"),
        }
    }
}

pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at state (field 3).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// CPU seconds used so far by every process named `comm` (e.g. `beam.smp`).
pub(crate) fn cpu_of_name(comm: &str) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm)
        })
        .filter_map(cpu_seconds)
        .sum()
}

/// CPU seconds of RabbitMQ, Redis and this process, to say where a phase's time went.
#[derive(Clone, Copy)]
pub(crate) struct CpuMark {
    rabbitmq: f64,
    redis: f64,
    bench: f64,
    machine: MachineTicks,
    at: Instant,
}

/// The whole machine's CPU time by kind (`cpu` line of /proc/stat, in ticks) and its
/// context switches so far: what no single process accounts for (softirq of the
/// loopback traffic, the scheduler).
#[derive(Clone, Copy, Default)]
struct MachineTicks {
    busy: u64,
    idle: u64,
    system: u64,
    steal: u64,
    switches: u64,
}

impl MachineTicks {
    fn now() -> Self {
        let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
            return Self::default();
        };
        let mut ticks = Self::default();
        for line in stat.lines() {
            let mut fields = line.split_whitespace();
            match fields.next() {
                Some("cpu") => {
                    // user nice system idle iowait irq softirq steal
                    let v: Vec<u64> = fields.take(8).filter_map(|f| f.parse().ok()).collect();
                    if v.len() == 8 {
                        ticks.idle = v[3] + v[4];
                        ticks.system = v[2] + v[5] + v[6];
                        ticks.steal = v[7];
                        ticks.busy = v[0] + v[1] + ticks.system;
                    }
                }
                Some("ctxt") => {
                    ticks.switches = fields.next().and_then(|f| f.parse().ok()).unwrap_or(0);
                }
                _ => {}
            }
        }
        ticks
    }
}

impl CpuMark {
    pub(crate) fn now() -> Self {
        Self {
            rabbitmq: cpu_of_name("beam.smp"),
            redis: cpu_of_name("redis-server"),
            bench: cpu_seconds(std::process::id()).unwrap_or(0.0),
            machine: MachineTicks::now(),
            at: Instant::now(),
        }
    }

    /// CPU microseconds per item since `self`, by process (the bridge's if given).
    pub(crate) fn per_item(&self, items: u64, bridge_cpu: Option<f64>) -> Value {
        let end = Self::now();
        let us = |s: f64| round2(s * 1e6 / items.max(1) as f64);
        json!({
            "wall_seconds": round2(end.at.duration_since(self.at).as_secs_f64()),
            "rabbitmq_us": us(end.rabbitmq - self.rabbitmq),
            "redis_us": us(end.redis - self.redis),
            "bench_process_us": us(end.bench - self.bench),
            "bridge_us": bridge_cpu.map(us),
            "note": "CPU per item of each process during the phase; RabbitMQ and Redis are shared with other users of this machine",
        })
    }
}

impl CpuMark {
    /// Cores each process kept busy since `self` (CPU seconds / wall seconds; the
    /// bridge's from its CPU seconds in the same span, if given), and the machine's
    /// cores, to show where a steady load meets the machine's limit.
    pub(crate) fn cores(&self, bridge_cpu: Option<f64>) -> Value {
        let end = Self::now();
        let wall = end.at.duration_since(self.at).as_secs_f64().max(1e-9);
        let cores = |s: f64| round2(s / wall);
        let (m0, m1) = (self.machine, end.machine);
        let total = (m1.busy + m1.idle + m1.steal).saturating_sub(m0.busy + m0.idle + m0.steal);
        let share = |a: u64, b: u64| round2(a.saturating_sub(b) as f64 / total.max(1) as f64);
        json!({
            "machine_idle": share(m1.idle, m0.idle),
            "machine_system": share(m1.system, m0.system),
            "machine_steal": share(m1.steal, m0.steal),
            "context_switches_per_s": (m1.switches.saturating_sub(m0.switches) as f64 / wall).round(),
            "wall_seconds": round2(wall),
            "rabbitmq": cores(end.rabbitmq - self.rabbitmq),
            "redis": cores(end.redis - self.redis),
            "bench_process": cores(end.bench - self.bench),
            "bridge": bridge_cpu.map(cores),
            "machine_cores": std::thread::available_parallelism().map_or(0, usize::from),
        })
    }
}

pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub(crate) async fn amqp(url: &str) -> Result<Connection> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .with_context(|| {
            format!(
                "connect to RabbitMQ at {} (bash scripts/services.sh starts it)",
                redisched::urls::redact_url(url)
            )
        })
}

pub(crate) async fn store(config: &Config) -> Result<Store> {
    Store::connect(&config.connect_options(), config.limits())
        .await
        .with_context(|| {
            format!(
                "connect to Redis at {} (bash scripts/services.sh starts it)",
                config.redis.url
            )
        })
}

pub(crate) fn durable_exchange() -> ExchangeDeclareOptions {
    ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    }
}

/// A durable queue (persistent messages really go to disk) bound to `exchange` with `#`.
pub(crate) async fn durable_queue(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    args: FieldTable,
) -> Result<()> {
    bound_queue(channel, queue, exchange, "#", args).await
}

/// A durable queue bound to `exchange` with `binding_key` only (a topic pattern).
pub(crate) async fn bound_queue(
    channel: &Channel,
    queue: &str,
    exchange: &str,
    binding_key: &str,
    args: FieldTable,
) -> Result<()> {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await
        .with_context(|| format!("declare queue {queue}"))?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            binding_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("bind queue {queue}"))?;
    Ok(())
}

/// The arguments of the bridge's commands queue that shape its speed (single active
/// consumer, and quorum when `amqp.quorum_queues`), for queues that stand in for it.
pub(crate) fn commands_queue_args(amqp: &redisched::config::AmqpConfig) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    if amqp.quorum_queues {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
    }
    args
}

pub(crate) async fn declare_exchange(channel: &Channel, exchange: &str) -> Result<()> {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            durable_exchange(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("declare exchange {exchange}"))?;
    Ok(())
}

/// Ready messages in a queue (passive declare).
pub(crate) async fn queue_depth(channel: &Channel, queue: &str) -> Result<u32> {
    redisched_testkit::queue_depth(channel, queue)
        .await
        .with_context(|| format!("inspect queue {queue}"))
}

/// The queues commands wait in: the one commands queue, or with command partitions the
/// route queue and every partition.
pub(crate) fn commands_queues(amqp: &redisched::config::AmqpConfig) -> Vec<String> {
    if amqp.command_partitions <= 1 {
        return vec![amqp.commands_queue.clone()];
    }
    std::iter::once(redisched::amqp::route_queue(amqp))
        .chain((0..amqp.command_partitions).map(|k| redisched::amqp::partition_queue(amqp, k)))
        .collect()
}

/// Whether every one of `queues` holds no ready message.
pub(crate) async fn queues_empty(channel: &Channel, queues: &[String]) -> Result<bool> {
    for queue in queues {
        if queue_depth(channel, queue).await? > 0 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Consumers of a queue (passive declare).
pub(crate) async fn queue_consumers(channel: &Channel, queue: &str) -> Result<u32> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .with_context(|| format!("inspect queue {queue}"))?;
    Ok(declared.consumer_count())
}

/// What a run created, deleted at the end (also after a failure).
pub(crate) struct Cleanup {
    pub amqp_url: String,
    pub redis_url: String,
    pub queues: Vec<String>,
    pub exchanges: Vec<String>,
    pub prefixes: Vec<String>,
}

impl Cleanup {
    pub(crate) fn for_config(config: &Config) -> Self {
        let a = &config.amqp;
        let mut queues = commands_queues(a);
        queues.extend([a.invalid_queue.clone(), a.expired_queue.clone()]);
        let mut exchanges = vec![
            a.commands_exchange.clone(),
            a.invalid_exchange.clone(),
            a.expired_exchange.clone(),
            a.ready_exchange.clone(),
        ];
        if a.command_partitions > 1 {
            exchanges.extend(
                (0..a.command_partitions).map(|k| redisched::amqp::partition_exchange(a, k)),
            );
        }
        Self {
            amqp_url: a.url.clone(),
            redis_url: config.redis.url.clone(),
            queues,
            exchanges,
            prefixes: vec![config.redis.prefix.clone()],
        }
    }

    pub(crate) async fn run(&self) {
        if let Ok(connection) = amqp(&self.amqp_url).await {
            if let Ok(channel) = connection.create_channel().await {
                for queue in &self.queues {
                    let _ = channel
                        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                for exchange in &self.exchanges {
                    let _ = channel
                        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                        .await;
                }
            }
            let _ = connection.close(200, "bench cleanup".into()).await;
        }
        for prefix in &self.prefixes {
            if let Err(err) = delete_prefix(&self.redis_url, prefix).await {
                eprintln!("  cleanup: could not delete Redis keys {prefix}:*: {err:#}");
            }
        }
    }
}

/// Deletes every key under `prefix:` (SCAN + UNLINK, on a blocking thread).
pub(crate) async fn delete_prefix(redis_url: &str, prefix: &str) -> Result<u64> {
    let (url, owned) = (redis_url.to_string(), prefix.to_string());
    let deleted =
        tokio::task::spawn_blocking(move || redisched_testkit::delete_prefix(&url, &owned))
            .await?
            .with_context(|| format!("delete Redis keys {prefix}:*"))?;
    Ok(deleted)
}

pub(crate) fn body(bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| b'a' + (i % 26) as u8).collect()
}

pub(crate) fn job_id(kind: &str, n: u64) -> String {
    format!("{kind}-{n:016}")
}

/// Puts `count` jobs (`kind-<n>`) through `Store::apply`, 1,000 per pipeline, 4 in flight.
pub(crate) async fn load_jobs(
    store: &Store,
    topic: &Topic,
    kind: &str,
    count: u64,
    body: &[u8],
    due: Due,
    label: &str,
) -> Result<Duration> {
    let started = Instant::now();
    let batches: Vec<(u64, u64)> = (0..count)
        .step_by(1000)
        .map(|s| (s, (s + 1000).min(count)))
        .collect();
    let mut done = 0u64;
    let mut results = stream::iter(batches.into_iter().map(|(from, to)| async move {
        let ops = (from..to)
            .map(|n| {
                Ok(Op::Put(PutRequest {
                    topic: topic.clone(),
                    id: JobId::new(job_id(kind, n))?,
                    body: body.to_vec(),
                    meta: Vec::new(),
                    due,
                    mode: PutMode::Keep,
                }))
            })
            .collect::<Result<Vec<Op>>>()?;
        let applied = store.apply(&ops).await?;
        if let Some(err) = applied.iter().find_map(|r| r.as_ref().err()) {
            bail!("a put was refused: {err}");
        }
        Ok(ops.len() as u64)
    }))
    .buffer_unordered(4);
    let mut ticker = Ticker::new();
    while let Some(n) = results.next().await {
        done += n?;
        if ticker.due() {
            progress(label, done, count, started);
        }
    }
    progress_done(label, done, started);
    Ok(started.elapsed())
}

/// Publishes `count` messages with confirms, at most `window` unconfirmed; `make(n)`
/// gives routing key, properties and body. Returns when all are confirmed. An empty
/// `label` prints no progress (publishers running side by side).
pub(crate) async fn publish_confirmed<F>(
    channel: &Channel,
    exchange: &str,
    count: u64,
    window: usize,
    label: &str,
    make: F,
) -> Result<Duration>
where
    F: Fn(u64) -> (String, BasicProperties, Vec<u8>),
{
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .ok();
    let permits = Arc::new(Semaphore::new(window));
    let (tx, mut rx) =
        mpsc::unbounded_channel::<(lapin::PublisherConfirm, tokio::sync::OwnedSemaphorePermit)>();
    let confirmer = tokio::spawn(async move {
        let mut refused = 0u64;
        while let Some((confirm, permit)) = rx.recv().await {
            match confirm.await {
                Ok(lapin::Confirmation::Ack(None)) => {}
                _ => refused += 1,
            }
            drop(permit);
        }
        refused
    });
    let started = Instant::now();
    let mut ticker = Ticker::new();
    for n in 0..count {
        let permit = permits.clone().acquire_owned().await?;
        let (key, props, body) = make(n);
        let confirm = channel
            .basic_publish(
                exchange.into(),
                key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &body,
                props,
            )
            .await
            .context("publish")?;
        let _ = tx.send((confirm, permit));
        if ticker.due() && !label.is_empty() {
            progress(label, n, count, started);
        }
    }
    drop(tx);
    let refused = confirmer.await?;
    if refused > 0 {
        bail!("{refused} publishes were not confirmed (nack or unroutable)");
    }
    if !label.is_empty() {
        progress_done(label, count, started);
    }
    Ok(started.elapsed())
}

/// Where a paced producer publishes its put commands, and how it names them.
#[derive(Clone, Debug)]
pub(crate) struct CommandRoute {
    pub exchange: String,
    pub routing_key: String,
    /// Message ids are `<id_prefix>-<n>`, n counting from 0.
    pub id_prefix: String,
    /// Each command names its due time as `x-deliver-at` (the publish instant on the
    /// producer's clock + the delay, rounded up to whole ms) instead of `x-delay`.
    pub deliver_at: bool,
}

/// What a paced producer did.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Paced {
    pub sent: u64,
    pub achieved_rate: f64,
    /// The most messages it was behind its schedule (0 = kept pace).
    pub behind_max: u64,
}

/// Unconfirmed commands a paced producer allows before it waits.
const PACED_WINDOW: usize = 5000;

/// Publishes put commands at `rate`/s, one per item of `delays` (its `x-delay`, ms),
/// until they run out or `stop` is set: every 5 ms it catches up with rate × elapsed.
/// Each carries the producer-clock headers, is persistent and confirmed. An empty
/// `label` prints no progress.
pub(crate) async fn publish_paced(
    channel: &Channel,
    route: &CommandRoute,
    rate: u64,
    mut delays: impl Iterator<Item = i64>,
    body: &[u8],
    stop: &std::sync::atomic::AtomicBool,
    label: &str,
) -> Result<Paced> {
    let window = Arc::new(Semaphore::new(PACED_WINDOW));
    let (tx, mut rx) =
        mpsc::unbounded_channel::<(lapin::PublisherConfirm, tokio::sync::OwnedSemaphorePermit)>();
    let confirmer = tokio::spawn(async move {
        let mut refused = 0u64;
        while let Some((confirm, _permit)) = rx.recv().await {
            if !matches!(confirm.await, Ok(lapin::Confirmation::Ack(None))) {
                refused += 1;
            }
        }
        refused
    });
    let started = Instant::now();
    let mut sent = 0u64;
    let mut behind_max = 0u64;
    let mut ticker = Ticker::new();
    'pacing: while !stop.load(Ordering::Relaxed) {
        let should = (started.elapsed().as_secs_f64() * rate as f64) as u64;
        behind_max = behind_max.max(should.saturating_sub(sent));
        while sent < should {
            let Some(delay) = delays.next() else {
                break 'pacing;
            };
            let permit = window.clone().acquire_owned().await?;
            // Read right before the publish: the producer's instant is this call's.
            let published_us = now_us();
            let mut headers = vec![if route.deliver_at {
                (
                    redisched::job::headers::DELIVER_AT,
                    AMQPValue::LongLongInt(ceil_ms(published_us + delay * 1000)),
                )
            } else {
                (
                    redisched::job::headers::DELAY,
                    AMQPValue::LongLongInt(delay),
                )
            }];
            headers.extend(producer_clock_headers(published_us, delay));
            let props = command_props(&format!("{}-{sent:010}", route.id_prefix), &headers);
            let confirm = channel
                .basic_publish(
                    route.exchange.as_str().into(),
                    route.routing_key.as_str().into(),
                    BasicPublishOptions::default(),
                    body,
                    props,
                )
                .await
                .context("publish a command")?;
            let _ = tx.send((confirm, permit));
            sent += 1;
        }
        if ticker.due() && !label.is_empty() {
            eprint!("\r  {label}: published {sent}      ");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(tx);
    let publish_secs = started.elapsed().as_secs_f64();
    let refused = confirmer.await?;
    if refused > 0 {
        bail!("{refused} commands were not confirmed by the broker");
    }
    Ok(Paced {
        sent,
        achieved_rate: sent as f64 / publish_secs.max(1e-9),
        behind_max,
    })
}

/// A put command as the wire contract defines it.
pub(crate) fn command_props(id: &str, headers: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        table.insert((*k).into(), v.clone());
    }
    BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
        .with_headers(table)
}

pub(crate) fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// The bench's own headers on the jobs whose lateness it measures: the producer's clock
/// (epoch µs) when it published the command, and when it wants the job (that instant +
/// `x-delay`). They are not `x-redisched-*` headers, so the bridge stores and forwards
/// them like any application header and they come back on the delivered job.
pub(crate) const PUBLISHED_US_HEADER: &str = "x-bench-published-us";
pub(crate) const PRODUCER_DUE_US_HEADER: &str = "x-bench-producer-due-us";

/// The producer-clock headers of a command published at `published_us` (epoch µs).
pub(crate) fn producer_clock_headers(
    published_us: i64,
    delay_ms: i64,
) -> [(&'static str, AMQPValue); 2] {
    [
        (PUBLISHED_US_HEADER, AMQPValue::LongLongInt(published_us)),
        (
            PRODUCER_DUE_US_HEADER,
            AMQPValue::LongLongInt(published_us + delay_ms * 1000),
        ),
    ]
}

/// Epoch µs rounded up to whole ms (due times are whole ms, never before the instant).
pub(crate) fn ceil_ms(us: i64) -> i64 {
    (us + 999).div_euclid(1000)
}

/// One delivery seen by a sink: arrival (epoch µs), `x-redisched-due-at` and the
/// producer-clock headers, each if present.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arrival {
    pub at_us: i64,
    pub due_at_ms: Option<i64>,
    pub published_us: Option<i64>,
    pub producer_due_us: Option<i64>,
}

impl Arrival {
    /// Lateness in ms against `x-redisched-due-at` (the due time the bridge computed).
    pub(crate) fn vs_due_at_ms(&self) -> Option<f64> {
        Some(self.at_us as f64 / 1000.0 - self.due_at_ms? as f64)
    }

    /// Lateness in ms against the producer's clock: publish instant + `x-delay`.
    pub(crate) fn vs_producer_ms(&self) -> Option<f64> {
        Some((self.at_us - self.producer_due_us?) as f64 / 1000.0)
    }
}

/// An integer header (any AMQP integer width).
pub(crate) fn int_header(properties: &BasicProperties, name: &str) -> Option<i64> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        AMQPValue::LongUInt(v) => Some(i64::from(*v)),
        AMQPValue::ShortInt(v) => Some(i64::from(*v)),
        _ => None,
    }
}

/// A consumer (auto-ack, prefetch 2,000) counting deliveries and, if `record`, sending
/// each one's arrival time.
pub(crate) struct Sink {
    pub count: Arc<AtomicU64>,
    pub arrivals: mpsc::UnboundedReceiver<Arrival>,
    channel: Channel,
}

impl Sink {
    /// Closes the consumer's channel.
    pub(crate) async fn stop(self) {
        let _ = self.channel.close(200, "done".into()).await;
    }
}

pub(crate) async fn sink(connection: &Connection, queue: &str, record: bool) -> Result<Sink> {
    let channel = connection.create_channel().await?;
    channel.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("consume {queue}"))?;
    let count = Arc::new(AtomicU64::new(0));
    let (tx, rx) = mpsc::unbounded_channel();
    let counter = count.clone();
    let handle = channel.clone();
    tokio::spawn(async move {
        while let Some(Ok(delivery)) = consumer.next().await {
            let at_us = now_us();
            counter.fetch_add(1, Ordering::Relaxed);
            if record {
                let props = &delivery.properties;
                let arrival = Arrival {
                    at_us,
                    due_at_ms: int_header(props, redisched::job::headers::DUE_AT),
                    published_us: int_header(props, PUBLISHED_US_HEADER),
                    producer_due_us: int_header(props, PRODUCER_DUE_US_HEADER),
                };
                if tx.send(arrival).is_err() {
                    break;
                }
            }
        }
    });
    Ok(Sink {
        count,
        arrivals: rx,
        channel: handle,
    })
}

pub(crate) fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// Counts sampled over time: (seconds since start, rate per second in that interval).
#[derive(Default, Clone)]
pub(crate) struct Series {
    pub points: Vec<(f64, f64)>,
    last: Option<(f64, u64)>,
}

impl Series {
    pub(crate) fn sample(&mut self, t: f64, total: u64) {
        if let Some((t0, n0)) = self.last {
            if t > t0 {
                self.points
                    .push((t, (total.saturating_sub(n0)) as f64 / (t - t0)));
            }
        }
        self.last = Some((t, total));
    }

    pub(crate) fn to_json(&self) -> Value {
        json!(self
            .points
            .iter()
            .map(|(t, r)| [(t * 100.0).round() / 100.0, r.round()])
            .collect::<Vec<_>>())
    }
}

/// A progress line at most every second.
pub(crate) struct Ticker(Instant);

impl Ticker {
    pub(crate) fn new() -> Self {
        Self(Instant::now())
    }
    pub(crate) fn due(&mut self) -> bool {
        if self.0.elapsed() >= Duration::from_secs(1) {
            self.0 = Instant::now();
            true
        } else {
            false
        }
    }
}

pub(crate) fn progress(label: &str, done: u64, total: u64, started: Instant) {
    let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-9);
    eprint!(
        "\r  {label}: {done}/{total} ({:.0}%, {rate:.0}/s)        ",
        100.0 * done as f64 / total.max(1) as f64
    );
    let _ = std::io::stderr().flush();
}

pub(crate) fn progress_done(label: &str, done: u64, started: Instant) {
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "\r  {label}: {done} in {secs:.2} s ({:.0}/s)                    ",
        done as f64 / secs.max(1e-9)
    );
}

pub(crate) fn per_sec(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

pub(crate) fn ratio(value: f64, ceiling: f64) -> f64 {
    if ceiling > 0.0 {
        value / ceiling
    } else {
        0.0
    }
}

/// Lateness percentiles in ms.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct Lateness {
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub early: usize,
}

impl Lateness {
    /// `values` in ms (negative = early); sorts them.
    pub(crate) fn of(values: &mut [f64]) -> Self {
        values.sort_by(|a, b| a.total_cmp(b));
        let sorted: &[f64] = values;
        let q = |p: f64| round2(redisched_testkit::percentile(sorted, p));
        Self {
            count: values.len(),
            p50_ms: q(0.50),
            p99_ms: q(0.99),
            p999_ms: q(0.999),
            max_ms: values.last().copied().map(round2).unwrap_or(0.0),
            early: values.iter().filter(|v| **v < 0.0).count(),
        }
    }
}

pub(crate) fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// Polls `check` every 50 ms until it is true or `timeout` passed (then fails).
pub(crate) async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn topic(name: &str) -> Result<Topic> {
    Topic::new(name).context("topic")
}

/// Which outcome-history settings a scenario measures: the default cap
/// (`history.max_per_topic` = 1000), none (0), or both alternating in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum HistoryChoice {
    Both,
    On,
    Off,
}

/// One side of an on/off comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum History {
    On,
    Off,
}

impl History {
    /// The history cap the store and the bridge are given.
    pub(crate) fn max(self) -> u32 {
        match self {
            History::On => redisched::store::DEFAULT_HISTORY_MAX,
            History::Off => 0,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            History::On => "on",
            History::Off => "off",
        }
    }

    /// Run `run` (0-based) of an alternating comparison: on first in even runs, off
    /// first in odd ones, so a drift of the shared machine does not favour one side.
    pub(crate) fn order(run: usize) -> [History; 2] {
        if run.is_multiple_of(2) {
            [History::On, History::Off]
        } else {
            [History::Off, History::On]
        }
    }
}

impl HistoryChoice {
    /// The sides measured in run `run`.
    pub(crate) fn sides(self, run: usize) -> Vec<History> {
        match self {
            HistoryChoice::Both => History::order(run).to_vec(),
            HistoryChoice::On => vec![History::On],
            HistoryChoice::Off => vec![History::Off],
        }
    }
}

/// Median, min and max of repeated measurements (the figure quoted for ≥ 3 runs).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: usize,
}

impl Spread {
    /// `None` for no values; the median of an even count is the mean of the middle two.
    pub(crate) fn of(values: &[f64]) -> Option<Self> {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(|a, b| a.total_cmp(b));
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Self {
            median,
            min: sorted[0],
            max: sorted[n - 1],
            runs: n,
        })
    }

    pub(crate) fn to_json(self, decimals: i32) -> Value {
        let scale = 10f64.powi(decimals);
        let r = |v: f64| (v * scale).round() / scale;
        json!({ "median": r(self.median), "min": r(self.min), "max": r(self.max), "runs": self.runs })
    }
}

/// `median (min–max)` of a JSON spread, with `decimals` digits; `-` if absent.
pub(crate) fn spread_text(v: &Value, decimals: usize) -> String {
    match (v["median"].as_f64(), v["min"].as_f64(), v["max"].as_f64()) {
        (Some(m), Some(lo), Some(hi)) => {
            format!("{m:.decimals$} ({lo:.decimals$}–{hi:.decimals$})")
        }
        _ => "-".into(),
    }
}

/// Load average (1, 5, 15 min) from /proc/loadavg, to print beside shared-machine figures.
pub(crate) fn load_average() -> Value {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| {
            let parts: Vec<f64> = s
                .split_whitespace()
                .take(3)
                .filter_map(|p| p.parse().ok())
                .collect();
            json!(parts)
        })
        .unwrap_or(Value::Null)
}

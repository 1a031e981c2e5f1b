//! Scenario 7 (catch-up after an outage): N jobs all due at once, and a topic
//! that must stay on time while they drain (fairness).
//!
//! While no bridge runs, the bench loads N jobs due now into one or several backlog
//! topics (`Store::apply` batches, as the dispatch scenario does), and a steady producer
//! publishes put commands for an on-time topic through the commands exchange (150/s,
//! delays 0–2 s, the producer-clock headers of the precision scenario); it starts
//! before the load, so commands queue up as in a real outage. Then a `redisched run`
//! starts, and the bench measures:
//! - the **drain rate**: N / the time from the bridge's start until a consumer on the
//!   ready exchange got every backlog job and the backlog topics are empty, beside the
//!   dispatch ceiling of the same run (the plain confirmed publisher of the dispatch
//!   scenario, before and after the bridge, averaged; at most 200,000 messages a run);
//! - the **on-time topic's lateness** while the backlog drains, vs
//!   `x-redisched-due-at` and vs the producer's clock, over the jobs published once the
//!   bridge consumed commands again and due (by the producer's clock) before the drain
//!   ended: the jobs published during the outage waited for the bridge, not for the
//!   backlog, and are counted apart.
//!
//! Redis memory is read before loading: the run stops early, with the figures, if N
//! jobs would not fit under `maxmemory` or in the memory the machine has available.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lapin::options::ConfirmSelectOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use redisched::job::{Due, Topic};
use serde_json::{json, Value};

use super::common::{self, Arrival, Bridge, Cleanup, CommandRoute, Env, Lateness, Paced};
use super::dispatch;

pub(super) struct Params {
    /// Backlog jobs, all due when the bridge starts.
    pub jobs: u64,
    /// Backlog topics the jobs are spread over (evenly).
    pub topics: usize,
    pub body_bytes: usize,
    /// The bridge's confirm window (`dispatch.window`) and the ceiling publisher's.
    pub window: usize,
}

/// The on-time topic's steady producer: commands per second and the largest delay.
const ON_TIME_RATE: u64 = 150;
const ON_TIME_MAX_DELAY_MS: u64 = 2_000;
const ON_TIME_TOPIC: &str = "ontime";
/// The on-time topic's target while the backlog drains.
const ON_TIME_TARGET_P99_MS: f64 = 100.0;
/// Messages per run of the ceiling publisher: enough for a steady rate.
const CEILING_MESSAGES: u64 = 200_000;
/// Redis bytes a job costs beyond its body and id, with a margin (about 210 measured).
const REDIS_BYTES_PER_JOB_BEYOND_BODY: u64 = 300;

pub(super) async fn run(env: &Env, params: &Params) -> Result<Value> {
    run_in(env, params, common::bench_config(env, "catchup")).await
}

/// [`run`] under the names (key prefix, exchanges, queues) of `config`, so a caller can
/// put other jobs beside the backlog first; everything under them is deleted at the end.
pub(super) async fn run_in(
    env: &Env,
    params: &Params,
    mut config: redisched::config::Config,
) -> Result<Value> {
    config.dispatch.window = params.window;
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    cleanup.queues.push(format!("{name}.backlog"));
    cleanup.queues.push(format!("{name}.ontime"));
    dispatch::CeilingPath::clean_up(&mut cleanup, &name);
    eprintln!(
        "catchup: {} jobs due at once over {} topic(s), on-time topic at {ON_TIME_RATE}/s with delays 0-{ON_TIME_MAX_DELAY_MS} ms (names {name}.*)",
        params.jobs,
        params.topics.max(1)
    );
    let result = measure(env, params, &config, &name).await;
    cleanup.run().await;
    result
}

async fn measure(
    env: &Env,
    params: &Params,
    config: &redisched::config::Config,
    name: &str,
) -> Result<Value> {
    let n = params.jobs;
    if n == 0 {
        bail!("--catchup-jobs must be > 0");
    }
    let window = config.dispatch.window;
    let connection = common::amqp(&env.amqp_url).await?;
    let setup = connection.create_channel().await?;
    redisched::amqp::declare_topology(&setup, &config.amqp).await?;
    let ready = &config.amqp.ready_exchange;
    let backlog_queue = format!("{name}.backlog");
    let on_time_queue = format!("{name}.ontime");
    common::bound_queue(
        &setup,
        &backlog_queue,
        ready,
        "backlog.#",
        FieldTable::default(),
    )
    .await?;
    common::bound_queue(
        &setup,
        &on_time_queue,
        ready,
        ON_TIME_TOPIC,
        FieldTable::default(),
    )
    .await?;
    let body = common::body(params.body_bytes);
    let ceiling = dispatch::CeilingPath::declare(&setup, name, window, &body).await?;
    let ceiling_n = n.min(CEILING_MESSAGES);
    let (before, _) = ceiling.measure(&connection, ceiling_n).await?;

    let mut redis = redis::Client::open(config.redis.url.as_str())?
        .get_multiplexed_async_connection()
        .await
        .context("connect to Redis for INFO memory")?;
    let memory_before = RedisMemory::read(&mut redis).await?;
    memory_before.check_room(n, params.body_bytes)?;

    let on_time = OnTime::start(&connection, &config.amqp.commands_exchange, &body).await?;
    let outcome = drain_with_on_time(
        env,
        params,
        config,
        &connection,
        &setup,
        &mut redis,
        &body,
        &backlog_queue,
        &on_time_queue,
    )
    .await;
    let produced = on_time.stop().await;
    let (drain, on_time_arrivals) = match (outcome, produced) {
        (Ok((drain, running)), Ok(produced)) => {
            (drain, running.collect_on_time(produced.sent).await?)
        }
        (Err(err), _) | (_, Err(err)) => return Err(err),
    };
    let (after, _) = ceiling.measure(&connection, ceiling_n).await?;
    let _ = connection.close(200, "bye".into()).await;

    let ceiling_rate = (before.rate + after.rate) / 2.0;
    let drain_rate = common::per_sec(n, drain.seconds);
    let ratio = common::ratio(drain_rate, ceiling_rate);
    let measured: Vec<&Arrival> = on_time_arrivals
        .iter()
        .filter(|a| drain.while_draining(a))
        .collect();
    let vs_due_at = lateness(&measured, Arrival::vs_due_at_ms)?;
    let vs_producer = lateness(&measured, Arrival::vs_producer_ms)?;
    let published_in_outage = on_time_arrivals
        .iter()
        .filter(|a| a.published_us.is_some_and(|p| p < drain.ingest_up_us))
        .count();
    eprintln!(
        "  drain: {drain_rate:.0} jobs/s ({:.0}% of the {ceiling_rate:.0}/s ceiling); on-time topic while draining ({} jobs): vs due-at p99 {} ms, vs producer clock p99 {} ms, early {} / {}",
        ratio * 100.0,
        vs_due_at.count,
        vs_due_at.p99_ms,
        vs_producer.p99_ms,
        vs_due_at.early,
        vs_producer.early
    );
    Ok(json!({
        "jobs": n,
        "topics": params.topics.max(1),
        "body_bytes": params.body_bytes,
        "window": window,
        "load": {
            "seconds": common::round2(drain.load_seconds),
            "jobs_per_s": common::per_sec(n, Duration::from_secs_f64(drain.load_seconds)).round(),
            "how": "Store::apply, batches of 1,000 puts, 4 in flight, while no bridge ran",
        },
        "redis_memory": {
            "used_before_bytes": memory_before.used,
            "used_after_load_bytes": drain.memory_after_load,
            "bytes_per_job": common::round2((drain.memory_after_load - memory_before.used as i64) as f64 / n as f64),
            "maxmemory_bytes": memory_before.max,
        },
        "drain": {
            "seconds": common::round2(drain.seconds.as_secs_f64()),
            "jobs_per_s": drain_rate.round(),
            "first_delivery_after_s": drain.first.map(|f| common::round2(f.as_secs_f64())),
            "cpu_per_job": drain.cpu_per_job,
            "bridge_rss_kib_peak": drain.rss_peak,
            "series": drain.series,
        },
        "ceiling": {
            "what": "the dispatch scenario's ceiling: plain lapin publisher, confirms, persistent, mandatory, same size and headers, same window, durable queue drained by one consumer; mean of a run before and one after the bridge",
            "messages_per_run": ceiling_n,
            "msgs_per_s": ceiling_rate.round(),
            "before_msgs_per_s": before.rate.round(),
            "after_msgs_per_s": after.rate.round(),
        },
        "ratio": common::round2(ratio),
        "target_ratio": 0.8,
        "on_time": {
            "rate_per_s": ON_TIME_RATE,
            "max_delay_ms": ON_TIME_MAX_DELAY_MS,
            "published": on_time_arrivals.len(),
            "published_during_outage": published_in_outage,
            "measured": vs_due_at.count,
            "measured_which": "published once the bridge consumed commands again, due (producer clock) before the backlog was drained",
            "lateness_ms": vs_due_at,
            "lateness_producer_clock_ms": vs_producer,
            "target_p99_ms": ON_TIME_TARGET_P99_MS,
        },
    }))
}

/// What the bridge did with the backlog, and what the on-time measurement needs.
struct Drain {
    load_seconds: f64,
    memory_after_load: i64,
    /// From the bridge's start until every backlog job was consumed and released.
    seconds: Duration,
    first: Option<Duration>,
    series: Value,
    rss_peak: Option<u64>,
    cpu_per_job: Value,
    /// When the bridge's ingest consumed the commands queue again (epoch µs).
    ingest_up_us: i64,
    /// When the backlog was drained (epoch µs).
    drained_us: i64,
}

/// The bridge, still running after the drain, and the on-time topic's consumer.
struct Running {
    bridge: Bridge,
    on_time_sink: common::Sink,
}

impl Drain {
    /// An on-time job that met a running bridge and fell due while the backlog drained.
    fn while_draining(&self, arrival: &Arrival) -> bool {
        arrival.published_us.is_some_and(|p| p >= self.ingest_up_us)
            && arrival
                .producer_due_us
                .is_some_and(|due| due <= self.drained_us)
    }
}

impl Running {
    /// Waits for the `published` on-time jobs, then stops the bridge.
    async fn collect_on_time(mut self, published: u64) -> Result<Vec<Arrival>> {
        let mut arrivals = Vec::with_capacity(published as usize);
        let deadline =
            Instant::now() + Duration::from_millis(ON_TIME_MAX_DELAY_MS) + Duration::from_secs(60);
        while (arrivals.len() as u64) < published {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.on_time_sink.arrivals.recv()).await {
                Ok(Some(arrival)) => arrivals.push(arrival),
                Ok(None) => bail!("the on-time consumer stopped"),
                Err(_) => bail!(
                    "only {} of {published} on-time jobs arrived",
                    arrivals.len()
                ),
            }
        }
        self.bridge.check_alive()?;
        self.bridge.stop()?;
        self.on_time_sink.stop().await;
        Ok(arrivals)
    }
}

/// Loads the backlog (the on-time producer already runs), starts the bridge and waits
/// until the backlog is drained.
#[allow(clippy::too_many_arguments)]
async fn drain_with_on_time(
    env: &Env,
    params: &Params,
    config: &redisched::config::Config,
    connection: &Connection,
    setup: &Channel,
    redis: &mut redis::aio::MultiplexedConnection,
    body: &[u8],
    backlog_queue: &str,
    on_time_queue: &str,
) -> Result<(Drain, Running)> {
    let n = params.jobs;
    let store = common::store(config).await?;
    let topic_count = params.topics.max(1) as u64;
    let topics = (0..topic_count)
        .map(|t| common::topic(&format!("backlog.{t}")))
        .collect::<Result<Vec<Topic>>>()?;
    let load_started = Instant::now();
    for (t, topic) in topics.iter().enumerate() {
        let t = t as u64;
        let count = n / topic_count + u64::from(t < n % topic_count);
        common::load_jobs(
            &store,
            topic,
            "job",
            count,
            body,
            Due::NOW,
            &format!("load backlog into {topic}"),
        )
        .await?;
    }
    let load_seconds = load_started.elapsed().as_secs_f64();
    let memory_after_load = RedisMemory::read(redis).await?.used as i64;

    let backlog_sink = common::sink(connection, backlog_queue, false).await?;
    let on_time_sink = common::sink(connection, on_time_queue, true).await?;
    let mark = common::CpuMark::now();
    let mut bridge = Bridge::start(env, config)?;
    let started = bridge.started;
    // From the moment ingest consumes again, a command meets a running bridge.
    let ingest_up_us = loop {
        bridge.check_alive()?;
        if common::queue_consumers(setup, &config.amqp.commands_queue).await? > 0 {
            break common::now_us();
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the bridge did not consume commands within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (consumed, series, first, rss_peak) = dispatch::watch_sink(
        &backlog_sink,
        n,
        started,
        Duration::from_secs(3600),
        Some(&mut bridge),
    )
    .await?;
    common::wait_until(
        "the backlog topics to empty",
        Duration::from_secs(60),
        || {
            let (store, topics) = (&store, &topics);
            async move {
                for topic in topics {
                    if store.stats(topic).await?.records > 0 {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        },
    )
    .await?;
    let seconds = started.elapsed().max(consumed);
    let drained_us = common::now_us();
    let cpu_per_job = mark.per_item(n, bridge.cpu_seconds());
    backlog_sink.stop().await;
    let drain = Drain {
        load_seconds,
        memory_after_load,
        seconds,
        first,
        series: series.to_json(),
        rss_peak,
        cpu_per_job,
        ingest_up_us,
        drained_us,
    };
    Ok((
        drain,
        Running {
            bridge,
            on_time_sink,
        },
    ))
}

fn lateness(arrivals: &[&Arrival], figure: impl Fn(&Arrival) -> Option<f64>) -> Result<Lateness> {
    let mut values = arrivals
        .iter()
        .map(|a| figure(a).context("an on-time job without its due-time headers"))
        .collect::<Result<Vec<f64>>>()?;
    Ok(Lateness::of(&mut values))
}

/// The on-time topic's producer, running in its own task until stopped.
struct OnTime {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Paced>>,
    channel: Channel,
}

impl OnTime {
    async fn start(connection: &Connection, commands_exchange: &str, body: &[u8]) -> Result<Self> {
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let route = CommandRoute {
            exchange: commands_exchange.to_string(),
            routing_key: ON_TIME_TOPIC.to_string(),
            id_prefix: ON_TIME_TOPIC.to_string(),
            deliver_at: false,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let (channel, stop, body) = (channel.clone(), stop.clone(), body.to_vec());
            async move {
                // Seeded: every run draws the same delays.
                let mut rng = StdRng::seed_from_u64(0x0711);
                let delays = std::iter::repeat_with(move || {
                    rng.random_range(0..=ON_TIME_MAX_DELAY_MS) as i64
                });
                common::publish_paced(&channel, &route, ON_TIME_RATE, delays, &body, &stop, "")
                    .await
            }
        });
        Ok(Self {
            stop,
            task,
            channel,
        })
    }

    /// Stops publishing; every command it sent is confirmed by then.
    async fn stop(self) -> Result<Paced> {
        self.stop.store(true, Ordering::Relaxed);
        let paced = self.task.await.context("the on-time producer panicked")?;
        let _ = self.channel.close(200, "done".into()).await;
        paced
    }
}

/// Redis `INFO memory`: bytes used and the `maxmemory` limit (0 = none).
struct RedisMemory {
    used: u64,
    max: u64,
}

impl RedisMemory {
    async fn read(redis: &mut redis::aio::MultiplexedConnection) -> Result<Self> {
        let info: String = redis::cmd("INFO").arg("memory").query_async(redis).await?;
        let field = |name: &str| -> Result<u64> {
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}:")))
                .and_then(|v| v.trim().parse().ok())
                .with_context(|| format!("INFO memory has no {name}"))
        };
        Ok(Self {
            used: field("used_memory")?,
            max: field("maxmemory")?,
        })
    }

    /// Fails before loading if `jobs` would not fit under `maxmemory` or in the
    /// machine's available memory (Redis runs on this host in the bench's set-up).
    fn check_room(&self, jobs: u64, body_bytes: usize) -> Result<()> {
        let per_job = body_bytes as u64 + 20 + REDIS_BYTES_PER_JOB_BEYOND_BODY;
        let need = jobs * per_job;
        eprintln!(
            "  Redis memory before loading: {} MiB used, maxmemory {}; {jobs} jobs need about {} MiB",
            self.used >> 20,
            if self.max == 0 { "none".to_string() } else { format!("{} MiB", self.max >> 20) },
            need >> 20
        );
        if self.max > 0 && self.used + need > self.max {
            bail!(
                "{jobs} jobs need about {} MiB but Redis has {} MiB left under maxmemory: lower --catchup-jobs",
                need >> 20,
                self.max.saturating_sub(self.used) >> 20
            );
        }
        if let Some(available) = available_memory_bytes() {
            if need > available {
                bail!(
                    "{jobs} jobs need about {} MiB but this machine has {} MiB available: lower --catchup-jobs",
                    need >> 20,
                    available >> 20
                );
            }
        }
        Ok(())
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn available_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

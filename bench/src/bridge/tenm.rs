//! `redisched-bench ten-million`: the store and the bridge with 10,000,000 waiting jobs
//! (20-byte ids, 100-byte bodies), `--runs` rounds, each on a fresh private
//! redis-server (persistence off) so the shared one is not filled and `INFO` counts
//! this run alone:
//! - **load**: the jobs through `Store::apply` (`put.lua` by pipelined `EVALSHA`, 1,000
//!   per pipeline, 4 in flight), due in 1–2 h; the put rate of every successive tenth
//!   (1,000,000 at full size) and `INFO memory` after it. Bytes per job are the
//!   `used_memory` delta / jobs, read right after the load and again once the topic's
//!   two big hash tables (the `jobs` hash, the `scheduled` ZSET's dict) finished
//!   rehashing: Redis moves a key's table only when the key is used, so a store left
//!   idle after growing past a power of two keeps both tables (`DEBUG HTSTATS-KEY`
//!   tells; absent lookups drive the rehash, as any traffic on the topic would);
//! - **dispatch tick**: the bridge's reserve (`reserve_many`, one topic, batch 200) on
//!   the huge topic with 200 jobs due at its head, their release, and a reserve with
//!   nothing due, as round trip and as `EVALSHA` time inside Redis (`INFO
//!   commandstats`), beside the same calls on a topic of 10,000 waiting jobs, the two
//!   alternating;
//! - **`GET /v1/topics`** of a `redisched run` with HTTP on, beside `GET /healthz` of
//!   the same server (no Redis);
//! - **catch-up**: the `catchup` scenario (1,000,000 jobs due at once, an on-time topic
//!   at 150/s) under the same prefix as the waiting jobs, so the bridge schedules both;
//!   its drain rate beside its same-run dispatch ceiling.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use clap::Args;
use futures_util::{stream, StreamExt};
use redis::aio::MultiplexedConnection;
use redisched::config::Config;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{Lease, Op, PutRequest, Store};
use serde_json::{json, Value};

use super::common::{self, Bridge, Env, Spread};
use super::{catchup, report};
use crate::private_redis::PrivateRedis;

#[derive(Args, Clone, Debug)]
pub(crate) struct TenMillionArgs {
    /// Waiting jobs [default: 10000000; quick 200000].
    #[arg(long)]
    pub jobs: Option<u64>,
    /// Jobs of the catch-up backlog, due at once [default: 1000000; quick 20000];
    /// 0 skips the catch-up.
    #[arg(long)]
    pub catchup_jobs: Option<u64>,
    /// Rounds, each on a fresh redis-server (medians need >= 3).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Body of every job, waiting and caught up.
    #[arg(long, default_value_t = 100)]
    pub body_bytes: usize,
    /// Reserve/release pairs per topic and round of the tick timing.
    #[arg(long, default_value_t = 50)]
    pub ticks: usize,
    /// `GET /v1/topics` (and `/healthz`) requests per round.
    #[arg(long, default_value_t = 20)]
    pub gets: usize,
    /// Confirm window of the catch-up's bridge and ceiling publisher.
    #[arg(long, default_value_t = 1000)]
    pub window: usize,
    /// Small sizes, one round's worth in about a minute (not a result).
    #[arg(long)]
    pub quick: bool,
    #[arg(long, default_value = "artifacts/bench-ten-million.json")]
    pub out: PathBuf,
    #[arg(
        long,
        env = "REDISCHED_AMQP__URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// The `redisched` binary to run as the bridge [default: beside this executable].
    #[arg(long)]
    pub bridge_bin: Option<PathBuf>,
}

const BATCH: u64 = 1000;
const IN_FLIGHT: usize = 4;
/// The bridge's default `dispatch.batch`: what one tick reserves of a topic at most.
const TICK_BATCH: usize = 200;
const SMALL_TOPIC_JOBS: u64 = 10_000;
const TTR: Duration = Duration::from_secs(600);
const ID_BYTES: u64 = 20;

struct Sizes {
    jobs: u64,
    catchup_jobs: u64,
}

pub(crate) async fn run(args: TenMillionArgs) -> Result<()> {
    let sizes = Sizes {
        jobs: args
            .jobs
            .unwrap_or(if args.quick { 200_000 } else { 10_000_000 }),
        catchup_jobs: args
            .catchup_jobs
            .unwrap_or(if args.quick { 20_000 } else { 1_000_000 }),
    };
    if sizes.jobs < BATCH {
        bail!("--jobs must be at least {BATCH}");
    }
    // No shared Redis is involved: the private servers' versions are in each round.
    let context = report::RunContext::start("", &args.amqp_url).await;
    let runs = args.runs.max(1);
    let mut rounds = Vec::with_capacity(runs);
    for round in 1..=runs {
        eprintln!("== ten-million round {round}/{runs}");
        rounds.push(one_round(&args, &sizes, round).await?);
    }
    let report = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "jobs": sizes.jobs,
        "catchup_jobs": sizes.catchup_jobs,
        "body_bytes": args.body_bytes,
        "id_bytes": ID_BYTES,
        "runs": runs,
        "context": context.finish(),
        "summary": summary(&rounds),
        "rounds": rounds,
    });
    print_table(&report);
    crate::write_report(&args.out, &report)
}

/// One round on a fresh private redis-server: load, memory, ticks, topics, catch-up.
async fn one_round(args: &TenMillionArgs, sizes: &Sizes, round: usize) -> Result<Value> {
    let started = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let node = PrivateRedis::start_with(&["--enable-debug-command", "local"]).await?;
    eprintln!(
        "private redis-server at {} (pid {})",
        node.url(),
        node.pid()
    );
    let env = Env::new(
        node.url(),
        args.amqp_url.clone(),
        args.bridge_bin.clone(),
        &[],
    )?;
    let config = common::bench_config(&env, "tenm");
    let result = measure_round(args, sizes, &env, &config, &node).await;
    // The catch-up cleans its names up itself; this covers a failure before it.
    common::Cleanup::for_config(&config).run().await;
    let mut value = result?;
    value["round"] = json!(round);
    value["started_utc"] = json!(started);
    value["ended_utc"] = json!(humantime::format_rfc3339_seconds(SystemTime::now()).to_string());
    Ok(value)
}

async fn measure_round(
    args: &TenMillionArgs,
    sizes: &Sizes,
    env: &Env,
    config: &Config,
    node: &PrivateRedis,
) -> Result<Value> {
    let mut conn = node.connect().await?;
    // DEBUG HTSTATS-KEY walks a whole table (24,000,000 buckets at full size): far
    // longer than the client's default reply timeout of 500 ms.
    conn.set_response_timeout(Duration::from_secs(60));
    let server = server_info(&conn).await?;
    let store = common::store(config).await?;
    let body = common::body(args.body_bytes);
    let waiting = common::topic("waiting")?;
    let small = common::topic("tick.small")?;

    let load_before = common::load_average();
    let before = MemoryInfo::read(&conn).await?;
    let step = (sizes.jobs / 10).max(BATCH) / BATCH * BATCH;
    let load_started = Instant::now();
    let steps = load_waiting(&store, &conn, &waiting, sizes.jobs, step, &body).await?;
    let load_seconds = load_started.elapsed().as_secs_f64();
    let memory = memory_after_load(
        &store,
        &conn,
        &waiting,
        sizes.jobs,
        args.body_bytes,
        &before,
    )
    .await?;
    let load = json!({
        "seconds": common::round2(load_seconds),
        "put_per_s": (sizes.jobs as f64 / load_seconds).round(),
        "steps": steps,
        "load_average": { "start": load_before, "end": common::load_average() },
        "how": "Store::apply (put.lua, pipelined EVALSHA), 1,000 puts per pipeline, 4 in flight, due in 1-2 h",
    });

    common::load_jobs(
        &store,
        &small,
        "job",
        SMALL_TOPIC_JOBS,
        &body,
        later(0),
        "load tick.small",
    )
    .await?;
    let tick = tick_timing(&store, &conn, &waiting, &small, args.ticks, &body).await?;
    let topics = topics_timing(env, config, args.gets, sizes.jobs).await?;
    let catchup = if sizes.catchup_jobs > 0 {
        let params = catchup::Params {
            jobs: sizes.catchup_jobs,
            topics: 1,
            body_bytes: args.body_bytes,
            window: args.window,
        };
        let load_start = common::load_average();
        let mut value = catchup::run_in(env, &params, config.clone()).await?;
        value["load_average"] = json!({ "start": load_start, "end": common::load_average() });
        value
    } else {
        Value::Null
    };
    Ok(json!({
        "redis": server,
        "load": load,
        "memory": memory,
        "tick": tick,
        "topics": topics,
        "catchup": catchup,
    }))
}

/// Waiting jobs are due in 1 to 2 hours, spread so the ZSET is not append-only.
fn later(n: u64) -> Due {
    Due::Delay(3_600_000 + ((n * 7_919) % 3_600_000) as i64)
}

fn put_ops(
    topic: &Topic,
    kind: &str,
    from: u64,
    to: u64,
    body: &[u8],
    due: impl Fn(u64) -> Due,
) -> Result<Vec<Op>> {
    (from..to)
        .map(|n| {
            Ok(Op::Put(PutRequest {
                topic: topic.clone(),
                id: JobId::new(common::job_id(kind, n))?,
                body: body.to_vec(),
                meta: Vec::new(),
                due: due(n),
                mode: PutMode::Keep,
            }))
        })
        .collect()
}

async fn apply_all(store: &Store, ops: &[Op]) -> Result<u64> {
    let applied = store.apply(ops).await.context("put batch")?;
    if let Some(err) = applied.iter().find_map(|r| r.as_ref().err()) {
        bail!("a put was refused: {err}");
    }
    Ok(applied.len() as u64)
}

/// Puts `jobs` waiting jobs; after every `step` of them, that step's put rate and
/// `INFO memory`.
async fn load_waiting(
    store: &Store,
    conn: &MultiplexedConnection,
    topic: &Topic,
    jobs: u64,
    step: u64,
    body: &[u8],
) -> Result<Vec<Value>> {
    let batches = (0..jobs)
        .step_by(BATCH as usize)
        .map(|from| (from, (from + BATCH).min(jobs)));
    let mut results = stream::iter(batches.map(|(from, to)| async move {
        apply_all(store, &put_ops(topic, "job", from, to, body, later)?).await
    }))
    .buffer_unordered(IN_FLIGHT);
    let started = Instant::now();
    let mut step_started = Instant::now();
    let (mut done, mut mark) = (0u64, 0u64);
    let mut steps = Vec::new();
    let mut ticker = common::Ticker::new();
    while let Some(n) = results.next().await {
        done += n?;
        if done - mark >= step || done == jobs {
            let seconds = step_started.elapsed().as_secs_f64();
            let memory = MemoryInfo::read(conn).await?;
            steps.push(json!({
                "jobs": done,
                "step_jobs": done - mark,
                "put_per_s": ((done - mark) as f64 / seconds).round(),
                "memory": memory.to_json(),
                "load_average": common::load_average(),
            }));
            (mark, step_started) = (done, Instant::now());
        }
        if ticker.due() {
            common::progress(&format!("put {topic}"), done, jobs, started);
        }
    }
    common::progress_done(&format!("put {topic}"), done, started);
    Ok(steps)
}

/// Bytes per job right after the load and once the big tables finished rehashing.
async fn memory_after_load(
    store: &Store,
    conn: &MultiplexedConnection,
    topic: &Topic,
    jobs: u64,
    body_bytes: usize,
    before: &MemoryInfo,
) -> Result<Value> {
    let keys = store.keys().topic(topic).0;
    let (scheduled, hash) = (&keys[0], &keys[2]);
    let after_load = MemoryInfo::settled(conn).await?;
    let rehashing_after_load = json!({
        "jobs_hash": rehashing(conn, hash).await,
        "scheduled_zset": rehashing(conn, scheduled).await,
    });
    eprintln!("  rehashing after the load: {rehashing_after_load}; driving it to its end");
    let lookups = finish_rehash(conn, hash, scheduled).await?;
    let rehashed = MemoryInfo::settled(conn).await?;
    let per_job = |m: &MemoryInfo| (m.used - before.used) as f64 / jobs as f64;
    let beyond = |m: &MemoryInfo| per_job(m) - (ID_BYTES + body_bytes as u64) as f64;
    eprintln!(
        "  bytes per job: {:.1} after the load ({:.1} beyond body + id), {:.1} rehashed ({:.1} beyond)",
        per_job(&after_load),
        beyond(&after_load),
        per_job(&rehashed),
        beyond(&rehashed)
    );
    Ok(json!({
        "before": before.to_json(),
        "after_load": after_load.to_json(),
        "rehashing_after_load": rehashing_after_load,
        "rehash_lookups": lookups,
        "rehashed": rehashed.to_json(),
        "bytes_per_job_after_load": common::round2(per_job(&after_load)),
        "beyond_body_id_after_load": common::round2(beyond(&after_load)),
        "bytes_per_job_rehashed": common::round2(per_job(&rehashed)),
        "beyond_body_id_rehashed": common::round2(beyond(&rehashed)),
        "memory_usage_keys_bytes_per_job": common::round2(memory_usage(conn, &keys).await? as f64 / jobs as f64),
    }))
}

/// The fields of `INFO memory` this scenario reports.
struct MemoryInfo {
    used: i64,
    lazyfree_pending: i64,
    fields: Value,
}

const MEMORY_FIELDS: [&str; 9] = [
    "used_memory",
    "used_memory_rss",
    "used_memory_peak",
    "mem_fragmentation_ratio",
    "allocator_allocated",
    "allocator_active",
    "allocator_resident",
    "allocator_frag_ratio",
    "allocator_rss_ratio",
];

impl MemoryInfo {
    async fn read(conn: &MultiplexedConnection) -> Result<Self> {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn.clone())
            .await?;
        let field = |name: &str| -> Option<String> {
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}:")))
                .map(|v| v.trim().to_string())
        };
        let mut fields = serde_json::Map::new();
        for name in MEMORY_FIELDS {
            if let Some(value) = field(name) {
                let number = value.parse::<f64>().ok();
                fields.insert(name.into(), number.map_or(json!(value), |n| json!(n)));
            }
        }
        Ok(Self {
            used: field("used_memory")
                .and_then(|v| v.parse().ok())
                .context("INFO memory has no used_memory")?,
            lazyfree_pending: field("lazyfree_pending_objects")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            fields: Value::Object(fields),
        })
    }

    /// Once lazy frees (UNLINK) finished, which would blur the figure.
    async fn settled(conn: &MultiplexedConnection) -> Result<Self> {
        for _ in 0..600 {
            let memory = Self::read(conn).await?;
            if memory.lazyfree_pending == 0 {
                return Ok(memory);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("lazy frees did not finish within 60 s")
    }

    fn to_json(&self) -> Value {
        self.fields.clone()
    }
}

/// The private server's version and allocator.
async fn server_info(conn: &MultiplexedConnection) -> Result<Value> {
    let mut text: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn.clone())
        .await?;
    let memory: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn.clone())
        .await?;
    text.push_str(&memory);
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_string())
    };
    Ok(json!({
        "version": field("redis_version"),
        "allocator": field("mem_allocator"),
        "persistence": "off (--save '' --appendonly no)",
    }))
}

/// Whether `key`'s hash table is being rehashed (`DEBUG HTSTATS-KEY` lists a
/// "rehashing target" then); `None` where DEBUG is refused.
async fn rehashing(conn: &MultiplexedConnection, key: &str) -> Option<bool> {
    let text: String = redis::cmd("DEBUG")
        .arg("HTSTATS-KEY")
        .arg(key)
        .query_async(&mut conn.clone())
        .await
        .ok()?;
    Some(text.contains("rehashing target"))
}

/// Lookups of an absent field and member until neither big table is rehashing (each
/// lookup moves a bucket); the lookups it took, `None` if DEBUG cannot tell.
async fn finish_rehash(
    conn: &MultiplexedConnection,
    hash: &str,
    zset: &str,
) -> Result<Option<u64>> {
    const CHUNK: u64 = 10_000;
    const PER_CHECK: u64 = 1_000_000;
    let mut lookups = 0u64;
    loop {
        match (rehashing(conn, hash).await, rehashing(conn, zset).await) {
            (Some(false), Some(false)) => return Ok(Some(lookups)),
            (None, _) | (_, None) => return Ok(None),
            _ => {}
        }
        if lookups > 100_000_000 {
            bail!("the tables still rehash after {lookups} lookups");
        }
        for _ in 0..PER_CHECK / CHUNK {
            let mut pipe = redis::pipe();
            for _ in 0..CHUNK {
                pipe.cmd("HEXISTS").arg(hash).arg("absent").ignore();
                pipe.cmd("ZSCORE").arg(zset).arg("absent").ignore();
            }
            pipe.query_async::<()>(&mut conn.clone()).await?;
        }
        lookups += PER_CHECK;
    }
}

/// `MEMORY USAGE` of the keys, estimated from 100,000 sampled entries each (an exact
/// count of 10,000,000 entries blocks Redis longer than a reply timeout).
async fn memory_usage(conn: &MultiplexedConnection, keys: &[String]) -> Result<i64> {
    let mut total = 0;
    for key in keys {
        let bytes: Option<i64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key)
            .arg("SAMPLES")
            .arg(100_000)
            .query_async(&mut conn.clone())
            .await?;
        total += bytes.unwrap_or(0);
    }
    Ok(total)
}

/// `EVALSHA` µs Redis counted so far (`INFO commandstats`): script run time only.
async fn evalsha_usec(conn: &MultiplexedConnection) -> Result<u64> {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    Ok(stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split([':', ',']).find_map(|p| p.strip_prefix("usec=")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0))
}

/// Runs `call`, returning its value, its round trip and the `EVALSHA` time inside
/// Redis meanwhile (µs; exact on a private server with no other client).
async fn timed<T, E>(
    conn: &MultiplexedConnection,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<(T, f64, f64)>
where
    anyhow::Error: From<E>,
{
    let before = evalsha_usec(conn).await?;
    let started = Instant::now();
    let value = call.await?;
    let rtt = started.elapsed().as_secs_f64() * 1e6;
    let after = evalsha_usec(conn).await?;
    Ok((value, rtt, after.saturating_sub(before) as f64))
}

/// Median, 90th percentile and max of `values`.
fn stats(values: &[f64]) -> Value {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| common::round2(redisched_testkit::percentile(&sorted, p));
    json!({ "n": sorted.len(), "median": q(0.5), "p90": q(0.9), "max": q(1.0) })
}

#[derive(Default)]
struct Samples {
    rtt_us: Vec<f64>,
    redis_us: Vec<f64>,
}

impl Samples {
    fn push(&mut self, rtt: f64, redis: f64) {
        self.rtt_us.push(rtt);
        self.redis_us.push(redis);
    }

    fn to_json(&self) -> Value {
        json!({ "rtt_us": stats(&self.rtt_us), "redis_us": stats(&self.redis_us) })
    }
}

/// One topic's calls of the tick timing.
#[derive(Default)]
struct TickSide {
    reserve: Samples,
    release: Samples,
    empty: Samples,
}

impl TickSide {
    fn to_json(&self) -> Value {
        json!({
            "reserve": self.reserve.to_json(),
            "release": self.release.to_json(),
            "reserve_nothing_due": self.empty.to_json(),
        })
    }
}

/// The bridge's reserve of one tick on the huge topic and on the small one,
/// alternating which goes first.
async fn tick_timing(
    store: &Store,
    conn: &MultiplexedConnection,
    huge: &Topic,
    small: &Topic,
    reps: usize,
    body: &[u8],
) -> Result<Value> {
    let load_start = common::load_average();
    let topics = [huge, small];
    let mut sides = [TickSide::default(), TickSide::default()];
    eprintln!("  tick timing: {reps} reserves of {TICK_BATCH} due jobs per topic");
    for rep in 0..reps.max(1) {
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            tick_once(store, conn, topics[i], rep as u64, &mut sides[i], body).await?;
        }
    }
    Ok(json!({
        "batch": TICK_BATCH,
        "reps": reps.max(1),
        "huge": sides[0].to_json(),
        "small": sides[1].to_json(),
        "small_waiting": SMALL_TOPIC_JOBS,
        "load_average": { "start": load_start, "end": common::load_average() },
    }))
}

/// Puts a tick's worth of jobs due now, reserves them as the bridge does, releases
/// them, then reserves with nothing due.
async fn tick_once(
    store: &Store,
    conn: &MultiplexedConnection,
    topic: &Topic,
    rep: u64,
    side: &mut TickSide,
    body: &[u8],
) -> Result<()> {
    let from = rep * TICK_BATCH as u64;
    let ops = put_ops(topic, "due", from, from + TICK_BATCH as u64, body, |_| {
        Due::NOW
    })?;
    apply_all(store, &ops).await?;
    let one = std::slice::from_ref(topic);
    let (batches, rtt, redis) = timed(conn, store.reserve_many(one, TTR, TICK_BATCH)).await?;
    let jobs = batches
        .into_iter()
        .next()
        .map(|b| b.jobs)
        .unwrap_or_default();
    if jobs.len() != TICK_BATCH {
        bail!(
            "a tick reserved {} of {TICK_BATCH} due jobs of {topic}",
            jobs.len()
        );
    }
    side.reserve.push(rtt, redis);
    let leases: Vec<Lease> = jobs
        .into_iter()
        .map(|job| Lease {
            topic: topic.clone(),
            id: job.id,
            token: job.token,
        })
        .collect();
    let (released, rtt, redis) = timed(conn, store.release(&leases)).await?;
    if released != TICK_BATCH as u64 {
        bail!("released {released} of {TICK_BATCH} jobs of {topic}");
    }
    side.release.push(rtt, redis);
    let (batches, rtt, redis) = timed(conn, store.reserve_many(one, TTR, TICK_BATCH)).await?;
    if batches.iter().any(|b| !b.jobs.is_empty()) {
        bail!("a reserve with nothing due in {topic} took jobs");
    }
    side.empty.push(rtt, redis);
    Ok(())
}

/// `GET /v1/topics` and `GET /healthz` of a `redisched run` with HTTP on, `gets` each,
/// alternating, on one kept-alive connection.
async fn topics_timing(env: &Env, config: &Config, gets: usize, jobs: u64) -> Result<Value> {
    let mut config = config.clone();
    let port = std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .context("finding a free port")?
        .port();
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{port}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let load_start = common::load_average();
    eprintln!("  GET /v1/topics: a bridge with HTTP on 127.0.0.1:{port}, {gets} requests");
    let mut bridge = Bridge::start(env, &config)?;
    let base = format!("http://127.0.0.1:{port}");
    let result = time_gets(&client, &base, &mut bridge, gets.max(1), jobs).await;
    let stopped = bridge.stop();
    let mut value = result?;
    stopped?;
    value["load_average"] = json!({ "start": load_start, "end": common::load_average() });
    Ok(value)
}

async fn time_gets(
    client: &reqwest::Client,
    base: &str,
    bridge: &mut Bridge,
    gets: usize,
    jobs: u64,
) -> Result<Value> {
    let started = Instant::now();
    loop {
        bridge.check_alive()?;
        let ready = client.get(format!("{base}/readyz")).send().await;
        if ready.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the bridge's HTTP server was not ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ready_after = started.elapsed().as_secs_f64();
    let (mut topics_ms, mut health_ms) = (Vec::new(), Vec::new());
    for i in 0..gets {
        let (ms, text) = get_text(client, &format!("{base}/v1/topics")).await?;
        if i == 0 {
            check_topics(&text, jobs)?;
        }
        topics_ms.push(ms);
        health_ms.push(get_text(client, &format!("{base}/healthz")).await?.0);
    }
    Ok(json!({
        "requests": gets,
        "ready_after_s": common::round2(ready_after),
        "topics_ms": stats(&topics_ms),
        "healthz_ms": stats(&health_ms),
    }))
}

/// A GET's time to the whole body (ms) and the body; fails on a non-2xx status.
async fn get_text(client: &reqwest::Client, url: &str) -> Result<(f64, String)> {
    let started = Instant::now();
    let response = client
        .get(url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    let text = response.text().await?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    if !status.is_success() {
        bail!("GET {url}: {status}: {text}");
    }
    Ok((ms, text))
}

/// The view must show every waiting job, or the timing measured something else.
fn check_topics(text: &str, jobs: u64) -> Result<()> {
    let view: Value = serde_json::from_str(text).context("GET /v1/topics: not JSON")?;
    let scheduled = view["topics"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["topic"] == "waiting"))
        .and_then(|row| row["scheduled"].as_u64());
    if scheduled != Some(jobs) {
        bail!(
            "GET /v1/topics shows {scheduled:?} scheduled jobs in topic waiting, expected {jobs}"
        );
    }
    Ok(())
}

/// (name, JSON pointer into a round, decimals) of every figure summarised over rounds.
const FIGURES: &[(&str, &str, i32)] = &[
    ("put_per_s", "/load/put_per_s", 0),
    (
        "bytes_per_job_after_load",
        "/memory/bytes_per_job_after_load",
        1,
    ),
    (
        "beyond_body_id_after_load",
        "/memory/beyond_body_id_after_load",
        1,
    ),
    (
        "bytes_per_job_rehashed",
        "/memory/bytes_per_job_rehashed",
        1,
    ),
    (
        "beyond_body_id_rehashed",
        "/memory/beyond_body_id_rehashed",
        1,
    ),
    (
        "memory_usage_keys_bytes_per_job",
        "/memory/memory_usage_keys_bytes_per_job",
        1,
    ),
    ("rehash_lookups", "/memory/rehash_lookups", 0),
    (
        "used_memory_after_load",
        "/memory/after_load/used_memory",
        0,
    ),
    (
        "used_memory_rss_after_load",
        "/memory/after_load/used_memory_rss",
        0,
    ),
    (
        "mem_fragmentation_ratio_after_load",
        "/memory/after_load/mem_fragmentation_ratio",
        2,
    ),
    (
        "allocator_frag_ratio_after_load",
        "/memory/after_load/allocator_frag_ratio",
        2,
    ),
    ("used_memory_rehashed", "/memory/rehashed/used_memory", 0),
    (
        "used_memory_rss_rehashed",
        "/memory/rehashed/used_memory_rss",
        0,
    ),
    (
        "mem_fragmentation_ratio_rehashed",
        "/memory/rehashed/mem_fragmentation_ratio",
        2,
    ),
    (
        "allocator_frag_ratio_rehashed",
        "/memory/rehashed/allocator_frag_ratio",
        2,
    ),
    (
        "tick_huge_reserve_rtt_us",
        "/tick/huge/reserve/rtt_us/median",
        0,
    ),
    (
        "tick_huge_reserve_redis_us",
        "/tick/huge/reserve/redis_us/median",
        0,
    ),
    (
        "tick_huge_reserve_rtt_max_us",
        "/tick/huge/reserve/rtt_us/max",
        0,
    ),
    (
        "tick_small_reserve_rtt_us",
        "/tick/small/reserve/rtt_us/median",
        0,
    ),
    (
        "tick_small_reserve_redis_us",
        "/tick/small/reserve/redis_us/median",
        0,
    ),
    (
        "tick_huge_release_rtt_us",
        "/tick/huge/release/rtt_us/median",
        0,
    ),
    (
        "tick_huge_release_redis_us",
        "/tick/huge/release/redis_us/median",
        0,
    ),
    (
        "tick_small_release_rtt_us",
        "/tick/small/release/rtt_us/median",
        0,
    ),
    (
        "tick_small_release_redis_us",
        "/tick/small/release/redis_us/median",
        0,
    ),
    (
        "tick_huge_empty_rtt_us",
        "/tick/huge/reserve_nothing_due/rtt_us/median",
        0,
    ),
    (
        "tick_huge_empty_redis_us",
        "/tick/huge/reserve_nothing_due/redis_us/median",
        0,
    ),
    (
        "tick_small_empty_rtt_us",
        "/tick/small/reserve_nothing_due/rtt_us/median",
        0,
    ),
    (
        "tick_small_empty_redis_us",
        "/tick/small/reserve_nothing_due/redis_us/median",
        0,
    ),
    ("topics_ms", "/topics/topics_ms/median", 2),
    ("topics_max_ms", "/topics/topics_ms/max", 2),
    ("healthz_ms", "/topics/healthz_ms/median", 2),
    ("catchup_drain_per_s", "/catchup/drain/jobs_per_s", 0),
    ("catchup_ceiling_per_s", "/catchup/ceiling/msgs_per_s", 0),
    ("catchup_ratio", "/catchup/ratio", 2),
    ("catchup_load_per_s", "/catchup/load/jobs_per_s", 0),
    (
        "on_time_p99_due_at_ms",
        "/catchup/on_time/lateness_ms/p99_ms",
        1,
    ),
    (
        "on_time_p99_producer_ms",
        "/catchup/on_time/lateness_producer_clock_ms/p99_ms",
        1,
    ),
    ("on_time_measured", "/catchup/on_time/measured", 0),
    (
        "on_time_early",
        "/catchup/on_time/lateness_producer_clock_ms/early",
        0,
    ),
];

/// Median (min–max) over the rounds of every figure, and of each load step's rate.
fn summary(rounds: &[Value]) -> Value {
    let spread = |pointer: &str, decimals: i32| {
        let values: Vec<f64> = rounds
            .iter()
            .filter_map(|r| r.pointer(pointer).and_then(Value::as_f64))
            .collect();
        Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals))
    };
    let mut out = serde_json::Map::new();
    for (name, pointer, decimals) in FIGURES {
        out.insert((*name).into(), spread(pointer, *decimals));
    }
    let steps = rounds
        .first()
        .and_then(|r| r.pointer("/load/steps").and_then(Value::as_array))
        .map_or(0, Vec::len);
    let per_step: Vec<Value> = (0..steps)
        .map(|i| {
            json!({
                "jobs": rounds[0].pointer(&format!("/load/steps/{i}/jobs")),
                "put_per_s": spread(&format!("/load/steps/{i}/put_per_s"), 0),
                "used_memory": spread(&format!("/load/steps/{i}/memory/used_memory"), 0),
                "mem_fragmentation_ratio": spread(&format!("/load/steps/{i}/memory/mem_fragmentation_ratio"), 2),
            })
        })
        .collect();
    out.insert("steps".into(), json!(per_step));
    Value::Object(out)
}

/// The summary table: (figure, value, beside); `{name:d}` is the median (min–max) of
/// summary figure `name` with d decimals.
const ROWS: &[(&str, &str, &str)] = &[
    ("put rate over the whole load (jobs/s)", "{put_per_s:0}", ""),
    (
        "Redis bytes per job right after the load (used_memory delta / jobs)",
        "{bytes_per_job_after_load:1}",
        "{beyond_body_id_after_load:1} beyond body + id",
    ),
    (
        "Redis bytes per job once the big tables finished rehashing",
        "{bytes_per_job_rehashed:1}",
        "{beyond_body_id_rehashed:1} beyond body + id; lookups it took {rehash_lookups:0}",
    ),
    ("MEMORY USAGE of the topic's keys / jobs (sampled)", "{memory_usage_keys_bytes_per_job:1}", ""),
    (
        "used_memory / used_memory_rss after the load (bytes)",
        "{used_memory_after_load:0} / {used_memory_rss_after_load:0}",
        "rehashed: {used_memory_rehashed:0} / {used_memory_rss_rehashed:0}",
    ),
    (
        "mem_fragmentation_ratio / allocator_frag_ratio after the load",
        "{mem_fragmentation_ratio_after_load:2} / {allocator_frag_ratio_after_load:2}",
        "rehashed: {mem_fragmentation_ratio_rehashed:2} / {allocator_frag_ratio_rehashed:2}",
    ),
    (
        "tick: reserve of 200 due jobs at the head of the huge topic, round trip / in Redis (µs)",
        "{tick_huge_reserve_rtt_us:0} / {tick_huge_reserve_redis_us:0}",
        "10,000-job topic: {tick_small_reserve_rtt_us:0} / {tick_small_reserve_redis_us:0}; slowest huge-topic call {tick_huge_reserve_rtt_max_us:0}",
    ),
    (
        "release of those 200, round trip / in Redis (µs)",
        "{tick_huge_release_rtt_us:0} / {tick_huge_release_redis_us:0}",
        "10,000-job topic: {tick_small_release_rtt_us:0} / {tick_small_release_redis_us:0}",
    ),
    (
        "tick with nothing due, round trip / in Redis (µs)",
        "{tick_huge_empty_rtt_us:0} / {tick_huge_empty_redis_us:0}",
        "10,000-job topic: {tick_small_empty_rtt_us:0} / {tick_small_empty_redis_us:0}",
    ),
    (
        "GET /v1/topics (ms; median of each round's requests)",
        "{topics_ms:2}",
        "slowest {topics_max_ms:2}; GET /healthz {healthz_ms:2}",
    ),
    (
        "catch-up drained beside the waiting jobs (jobs/s)",
        "{catchup_drain_per_s:0}",
        "dispatch ceiling {catchup_ceiling_per_s:0}; ratio {catchup_ratio:2} (goal >= 0.80); backlog loaded at {catchup_load_per_s:0}/s",
    ),
    (
        "on-time topic while draining: p99 vs due-at / vs producer clock (ms)",
        "{on_time_p99_due_at_ms:1} / {on_time_p99_producer_ms:1}",
        "goal <= 100; {on_time_measured:0} jobs measured, early {on_time_early:0}",
    ),
];

/// `template` with every `{name:d}` replaced by summary figure `name`'s spread.
fn fill(template: &str, summary: &Value) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let field = &rest[open + 1..open + close];
        let (name, decimals) = field.split_once(':').unwrap_or((field, "0"));
        let decimals = decimals.parse().unwrap_or(0);
        out.push_str(&common::spread_text(&summary[name], decimals));
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

fn print_table(report: &Value) {
    let s = &report["summary"];
    let c = &report["context"];
    println!();
    println!(
        "redisched-bench ten-million, {} to {}, commit {}; load average at start {} end {}",
        c["started_utc"].as_str().unwrap_or(""),
        c["ended_utc"].as_str().unwrap_or(""),
        c["git_commit"].as_str().unwrap_or(""),
        c["load_average"]["start"],
        c["load_average"]["end"]
    );
    println!(
        "{} waiting jobs ({}-byte bodies, {}-byte ids), {} rounds, each on a fresh private redis-server",
        report["jobs"], report["body_bytes"], report["id_bytes"], report["runs"]
    );
    println!("command: {}", report["command"].as_str().unwrap_or(""));
    println!();
    println!("| jobs waiting after the step | put rate of the step (jobs/s) | used_memory (bytes) | mem_fragmentation_ratio |");
    println!("|---:|---:|---:|---:|");
    for step in s["steps"].as_array().into_iter().flatten() {
        println!(
            "| {} | {} | {} | {} |",
            step["jobs"],
            common::spread_text(&step["put_per_s"], 0),
            common::spread_text(&step["used_memory"], 0),
            common::spread_text(&step["mem_fragmentation_ratio"], 2)
        );
    }
    println!();
    println!("| figure, median (min–max) of the rounds | value | beside |");
    println!("|---|---:|---|");
    for (label, value, beside) in ROWS {
        println!("| {label} | {} | {} |", fill(value, s), fill(beside, s));
    }
}

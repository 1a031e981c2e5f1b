//! `redisched-bench`: measurements against the live Redis, each beside a ceiling
//! measured in the same run (absolute numbers on shared machines drift; ratios less).
//!
//! ```text
//! cargo run --release -p redisched-bench -- store            # 1,000,000 jobs
//! cargo run --release -p redisched-bench -- store --quick    # 20,000 jobs, < 30 s
//! cargo run --release -p redisched-bench -- store --scale    # also 10,000,000 waiting
//! cargo run --release -p redisched-bench -- all --quick      # every scenario, bridge too
//! cargo run --release -p redisched-bench -- store --history on   # only the history-on side
//! cargo run --release -p redisched-bench -- put-cost --private-redis   # put.lua vs bare script
//! cargo run --release -p redisched-bench -- layout   # today's record layout vs bucketed
//! cargo run --release -p redisched-bench -- instructions   # bridge instructions per command/job (callgrind)
//! cargo run --release -p redisched-bench -- ten-million    # 10,000,000 waiting jobs, 3 rounds (~25 min)
//! cargo run --release -p redisched-bench -- report --stdout   # the performance page's table
//! ```
//!
//! `store` and `dispatch` compare the outcome history on (cap 1000) and off
//! (0) in the same run by default (`--history both`, `--runs 3`): medians (min–max) of
//! the rounds and the on/off ratio paired per round.
//!
//! (`all` and the bridge scenarios run the `redisched` binary beside this one: build it
//! too, `cargo build --release -p redisched-bench -p redisched`.) The store bench is
//! this file; the bridge scenarios (dispatch, ingest, precision, cancel, catchup, webhook, peer,
//! all) live in `bridge/`.
//!
//! Everything lives under a unique key prefix that is deleted at the end (also after a
//! failure); the prefix is printed first so an interrupted run can be cleaned by hand.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use futures_util::{stream, StreamExt};
use redis::aio::MultiplexedConnection;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{ConnectOptions, Lease, Limits, Op, PutRequest, Store, MAX_BATCH};
use serde_json::{json, Value};

use bridge::common::{History, HistoryChoice, Spread};

mod bridge;
mod instructions;
mod layout;
mod private_redis;
mod put_cost;
mod replication;

#[derive(Parser)]
#[command(
    name = "redisched-bench",
    about = "Measure redisched against the live Redis"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The job store: bytes per job, put and reserve+release throughput, cost at scale,
    /// each beside the raw Redis ceiling.
    Store(StoreArgs),
    /// Only the put cost comparison of `store`: put.lua and Store::apply
    /// beside a bare ZADD+HSET script given the same keys and arguments.
    PutCost(PutCostArgs),
    /// The layout study: bytes per job and rates of today's record layout
    /// beside records in small bucket hashes, on a private redis-server.
    Layout(LayoutArgs),
    #[command(flatten)]
    Bridge(bridge::BridgeCommand),
    /// Instructions of the bridge process (valgrind callgrind) per ingested command and
    /// per dispatched job, Redis's EVALSHA time per command and per job in the same run,
    /// and put.lua beside a bare ZADD+HSET script.
    Instructions(instructions::InstructionsArgs),
    /// Ingest with redis.wait_replicas 0 vs 1 on a primary with a replica: throughput,
    /// command latency, and the raw WAIT floor.
    Replication(replication::ReplicationArgs),
    /// The performance page's first table from the results `all` saved in
    /// bench/results: each figure beside its same-run reference, the ratio, the date,
    /// commit and command; written between the page's report markers.
    Report(bridge::page::ReportArgs),
    /// One bridge scenario with two `redisched` binaries (`--baseline-bin`, then
    /// `--bridge-bin`), rounds interleaved; per figure both medians (min–max) and
    /// whether the candidate's median lies within the baseline's spread.
    Compare(Box<bridge::compare::CompareArgs>),
    /// 10,000,000 waiting jobs on a private redis-server, `--runs` rounds: the put rate
    /// per million while the store grows, bytes per job and fragmentation, a dispatch
    /// tick's reserve, `GET /v1/topics`, and a 1,000,000-job catch-up beside them.
    TenMillion(bridge::tenm::TenMillionArgs),
}

#[derive(Args, Clone)]
struct StoreArgs {
    /// Jobs kept waiting for the memory and scale measurements.
    #[arg(long, default_value_t = 1_000_000)]
    jobs: u64,
    /// Small run for CI: 20,000 jobs (overrides --jobs), finishes in well under 30 s.
    #[arg(long)]
    quick: bool,
    /// Also measure with 10,000,000 jobs waiting (about 2 GB of Redis memory).
    #[arg(long)]
    scale: bool,
    /// Where to write the JSON report.
    #[arg(long, default_value = "artifacts/bench-store.json")]
    out: PathBuf,
    #[arg(
        long,
        env = "REDISCHED_REDIS__URL",
        default_value = "redis://127.0.0.1:6379/0"
    )]
    redis_url: String,
    /// Body size in bytes of every job.
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    /// Store::apply batches (pipelines) in flight at once.
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    /// Outcome history: `both` measures put, reserve+release and bytes per
    /// job with the default cap (1000) and without (0), alternating, `--runs` times;
    /// `on`/`off` run only that side (and the main figures with it).
    #[arg(long, value_enum, default_value_t = HistoryChoice::Both)]
    history: HistoryChoice,
    /// Alternating on/off rounds of the history comparison (medians need >= 3).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Jobs per side and round of the history comparison [default: 100000; quick 10000].
    #[arg(long)]
    history_jobs: Option<u64>,
    /// Jobs per side and round of the put cost comparison (`--runs` rounds)
    /// [default: 100000; quick 10000].
    #[arg(long)]
    put_cost_jobs: Option<u64>,
    /// Run against a redis-server of our own (started on a free port, stopped at the
    /// end) instead of --redis-url: memory deltas and command statistics then count
    /// this run alone, and the server's CPU per call is measured.
    #[arg(long)]
    private_redis: bool,
}

#[derive(Args, Clone)]
struct LayoutArgs {
    /// Waiting jobs per side and round (the memory figure) [default: 1000000; quick 20000].
    #[arg(long)]
    jobs: Option<u64>,
    /// Due jobs per side and round, reserved and released [default: 100000; quick 10000].
    #[arg(long)]
    due_jobs: Option<u64>,
    /// Rounds (medians need >= 3).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[arg(long)]
    quick: bool,
    /// `hash-max-listpack-value` while the `buckets` side writes (a record of a
    /// 100-byte body is 122 bytes).
    #[arg(long, default_value_t = 256)]
    listpack_value: u64,
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    #[arg(long, default_value = "artifacts/bench-layout.json")]
    out: PathBuf,
}

#[derive(Args, Clone)]
struct PutCostArgs {
    /// Jobs per side and round [default: 100000; quick 10000].
    #[arg(long)]
    jobs: Option<u64>,
    /// Rounds (medians need >= 3).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// 10,000 jobs per side and round.
    #[arg(long)]
    quick: bool,
    /// See `store --private-redis`.
    #[arg(long)]
    private_redis: bool,
    #[arg(
        long,
        env = "REDISCHED_REDIS__URL",
        default_value = "redis://127.0.0.1:6379/0"
    )]
    redis_url: String,
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    #[arg(long, default_value = "artifacts/bench-put-cost.json")]
    out: PathBuf,
    /// Another put.lua to run as a fourth side, e.g. the previous version:
    /// `git show <commit>:lua/put.lua > /tmp/put-before.lua`.
    #[arg(long)]
    other_put: Option<PathBuf>,
}

/// Ids are exactly this long ("job-" and 16 digits), as the issue asks.
const ID_BYTES: usize = 20;
const PUT_BATCH: usize = 1000;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Store(args) => store_bench(args).await,
        Command::PutCost(args) => put_cost_bench(args).await,
        Command::Instructions(args) => instructions::run(args).await,
        Command::Layout(args) => layout_bench(args).await,
        Command::Bridge(command) => bridge::run(command, store_for_all).await,
        Command::Replication(args) => replication::run(args).await,
        Command::TenMillion(args) => bridge::tenm::run(args).await,
        Command::Report(args) => bridge::page::run(&args),
        Command::Compare(args) => bridge::compare::run(*args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("redisched-bench: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// `all` runs the store bench through its own command line, so defaults stay in step.
async fn store_for_all(quick: bool, out: PathBuf) -> Result<()> {
    let mut argv = vec![
        "redisched-bench".into(),
        "store".into(),
        "--out".into(),
        out.into_os_string(),
    ];
    if quick {
        argv.push("--quick".into());
    }
    match Cli::try_parse_from(argv)?.command {
        Command::Store(args) => store_bench(args).await,
        _ => bail!("internal: not the store command"),
    }
}

fn job_id(kind: &str, n: u64) -> Result<JobId> {
    let id = format!("{kind}-{n:016}");
    debug_assert_eq!(id.len(), ID_BYTES);
    JobId::new(id).context("job id")
}

fn progress(label: &str, done: u64, total: u64, started: Instant) {
    let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-9);
    eprint!(
        "\r  {label}: {done}/{total} ({:.0}%, {rate:.0}/s)   ",
        100.0 * done as f64 / total.max(1) as f64
    );
    let _ = std::io::stderr().flush();
}

struct Bench {
    store: Store,
    /// Our own connection for raw commands (INFO, MEMORY USAGE, the ceiling script).
    conn: MultiplexedConnection,
    body: Vec<u8>,
    in_flight: usize,
}

impl Bench {
    /// Puts ids `from..to` of `kind` into `topic` through `Store::apply`, `PUT_BATCH` per
    /// pipeline and `in_flight` pipelines at once. Returns the elapsed time.
    async fn put_range(
        &self,
        topic: &Topic,
        kind: &str,
        from: u64,
        to: u64,
        due: impl Fn(u64) -> Due,
    ) -> Result<Duration> {
        let mut batches = Vec::new();
        let mut start = from;
        while start < to {
            let end = (start + PUT_BATCH as u64).min(to);
            let mut ops = Vec::with_capacity((end - start) as usize);
            for n in start..end {
                ops.push(Op::Put(PutRequest {
                    topic: topic.clone(),
                    id: job_id(kind, n)?,
                    body: self.body.clone(),
                    meta: Vec::new(),
                    due: due(n),
                    mode: PutMode::Keep,
                }));
            }
            batches.push(ops);
            start = end;
        }
        let total = to - from;
        let started = Instant::now();
        let mut done = 0u64;
        let mut results = stream::iter(batches.iter().map(|ops| self.store.apply(ops)))
            .buffer_unordered(self.in_flight);
        let mut last = Instant::now();
        while let Some(result) = results.next().await {
            let applied = result.context("put batch")?;
            if let Some(err) = applied.iter().find_map(|r| r.as_ref().err()) {
                bail!("a put was refused: {err}");
            }
            done += applied.len() as u64;
            if total >= 50_000 && last.elapsed() > Duration::from_millis(500) {
                progress(&format!("put {topic}"), done, total, started);
                last = Instant::now();
            }
        }
        let elapsed = started.elapsed();
        if total >= 50_000 {
            progress(&format!("put {topic}"), done, total, started);
            eprintln!();
        }
        Ok(elapsed)
    }

    /// Reserves every due job of `topic` (batches of 1000), then releases them.
    /// Returns (jobs, reserve time, release time).
    async fn reserve_then_release(&self, topic: &Topic) -> Result<(u64, Duration, Duration)> {
        let mut leases = Vec::new();
        let started = Instant::now();
        loop {
            let batch = self
                .store
                .reserve(topic, Duration::from_secs(600), MAX_BATCH)
                .await?;
            if batch.jobs.is_empty() {
                break;
            }
            leases.extend(batch.jobs.into_iter().map(|job| Lease {
                topic: topic.clone(),
                id: job.id,
                token: job.token,
            }));
        }
        let reserve = started.elapsed();
        let started = Instant::now();
        let mut released = 0;
        let mut results = stream::iter(
            leases
                .chunks(MAX_BATCH)
                .map(|chunk| self.store.release(chunk)),
        )
        .buffer_unordered(self.in_flight);
        while let Some(result) = results.next().await {
            released += result?;
        }
        if released != leases.len() as u64 {
            bail!("released {released} of {} reserved jobs", leases.len());
        }
        Ok((released, reserve, started.elapsed()))
    }

    /// The bridge's loop, `workers` at once: reserve up to 1000, release them, repeat
    /// until the topic has nothing due. Returns (jobs, elapsed).
    async fn drain(&self, topic: &Topic, workers: usize, total: u64) -> Result<(u64, Duration)> {
        let started = Instant::now();
        let moved_total = std::sync::atomic::AtomicU64::new(0);
        let worker = |_| async {
            let mut moved = 0u64;
            loop {
                let batch = self
                    .store
                    .reserve(topic, Duration::from_secs(600), MAX_BATCH)
                    .await?;
                if batch.jobs.is_empty() {
                    return Ok::<u64, anyhow::Error>(moved);
                }
                let leases: Vec<Lease> = batch
                    .jobs
                    .into_iter()
                    .map(|job| Lease {
                        topic: topic.clone(),
                        id: job.id,
                        token: job.token,
                    })
                    .collect();
                let released = self.store.release(&leases).await?;
                moved += released;
                let before = moved_total.fetch_add(released, std::sync::atomic::Ordering::Relaxed);
                if total >= 50_000 && (before + released) / 20_000 != before / 20_000 {
                    progress("reserve+release", before + released, total, started);
                }
            }
        };
        let counts = futures_util::future::try_join_all((0..workers).map(worker)).await?;
        if total >= 50_000 {
            eprintln!();
        }
        Ok((counts.iter().sum(), started.elapsed()))
    }

    async fn used_memory(&self) -> Result<i64> {
        // Wait for lazy frees (UNLINK) to finish so they do not blur the figure.
        for _ in 0..600 {
            let info: String = redis::cmd("INFO")
                .arg("memory")
                .query_async(&mut self.conn.clone())
                .await?;
            let field = |name: &str| -> Option<i64> {
                info.lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}:")))
                    .and_then(|v| v.trim().parse().ok())
            };
            if field("lazyfree_pending_objects").unwrap_or(0) == 0 {
                return field("used_memory").context("INFO memory has no used_memory");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("lazy frees did not finish within 60 s")
    }

    /// `MEMORY USAGE` of a key holding about `elements` entries: exact (every entry)
    /// up to 2,000,000 of them; above that an estimate from 100,000 samples, because an
    /// exact count of 10,000,000 entries blocks Redis longer than the reply timeout.
    async fn memory_usage(&self, key: &str, elements: u64) -> Result<i64> {
        let samples: u64 = if elements <= 2_000_000 { 0 } else { 100_000 };
        let bytes: Option<i64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key)
            .arg("SAMPLES")
            .arg(samples)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(bytes.unwrap_or(0))
    }
}

/// The raw ceiling of one script call: `redis-benchmark -q -n 200000 -P 50 EVAL "return 1" 0`.
fn redis_benchmark(url: &url::Url, requests: u64) -> Result<(String, f64)> {
    let host = url.host_str().unwrap_or("127.0.0.1").to_string();
    let port = url.port().unwrap_or(6379).to_string();
    let n = requests.to_string();
    let args = [
        "-h", &host, "-p", &port, "-q", "-n", &n, "-P", "50", "EVAL", "return 1", "0",
    ];
    let command = format!(
        "redis-benchmark {}",
        args.map(|a| if a.contains(' ') {
            format!("\"{a}\"")
        } else {
            a.to_string()
        })
        .join(" ")
    );
    let output = std::process::Command::new("redis-benchmark")
        .args(args)
        .output()
        .context("running redis-benchmark (Debian package redis-tools)")?;
    let text = String::from_utf8_lossy(&output.stdout);
    let rate = text
        .split(['\r', '\n'])
        .filter_map(|segment| segment.split_once(": ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split_once(" requests per second"))
        .filter_map(|(number, _)| number.trim().parse::<f64>().ok())
        .next_back()
        .with_context(|| format!("no 'requests per second' in redis-benchmark output: {text}"))?;
    Ok((command, rate))
}

/// A minimal "schedule" script, ZADD + HSET, pipelined from Rust exactly like puts:
/// what any scheduler on Redis must at least do per job.
async fn zadd_hset_ceiling(bench: &Bench, prefix: &str, jobs: u64) -> Result<f64> {
    let script = redis::Script::new(
        "redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1]) redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) return 1",
    );
    let zset = format!("{prefix}:{{ceiling}}:z");
    let hash = format!("{prefix}:{{ceiling}}:h");
    let mut conn = bench.conn.clone();
    let _: String = script.prepare_invoke().load_async(&mut conn).await?;
    let due_base = 4_000_000_000_000u64;
    let mut pipes = Vec::new();
    let mut start = 0;
    while start < jobs {
        let end = (start + PUT_BATCH as u64).min(jobs);
        let mut pipe = redis::pipe();
        for n in start..end {
            let id = format!("job-{n:016}");
            pipe.invoke_script(
                script
                    .key(&zset)
                    .key(&hash)
                    .arg(id)
                    .arg(due_base + n)
                    .arg(&bench.body[..]),
            );
        }
        pipes.push(pipe);
        start = end;
    }
    let started = Instant::now();
    let mut results = stream::iter(pipes.iter().map(|pipe| {
        let mut conn = bench.conn.clone();
        async move { pipe.query_async::<Vec<i64>>(&mut conn).await }
    }))
    .buffer_unordered(bench.in_flight);
    while let Some(result) = results.next().await {
        result?;
    }
    let rate = jobs as f64 / started.elapsed().as_secs_f64();
    let _: u64 = redis::cmd("UNLINK")
        .arg(&zset)
        .arg(&hash)
        .query_async(&mut conn)
        .await?;
    Ok(rate)
}

fn per_sec(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

fn micros_per(n: u64, d: Duration) -> f64 {
    d.as_secs_f64() * 1e6 / n.max(1) as f64
}

/// Where a store measurement runs: the Redis of `--redis-url`, or a private one.
struct Target {
    redis_url: String,
    /// Kept alive for the run; its pid for the server's CPU time.
    private: Option<private_redis::PrivateRedis>,
}

impl Target {
    async fn open(redis_url: &str, private: bool) -> Result<Self> {
        if !private {
            return Ok(Self {
                redis_url: redis_url.to_string(),
                private: None,
            });
        }
        let node = private_redis::PrivateRedis::start().await?;
        eprintln!(
            "private redis-server at {} (pid {})",
            node.url(),
            node.pid()
        );
        Ok(Self {
            redis_url: node.url(),
            private: Some(node),
        })
    }

    fn server_pid(&self) -> Option<u32> {
        self.private.as_ref().map(|node| node.pid())
    }

    /// A store and a raw connection under a fresh key prefix.
    async fn bench(
        &self,
        prefix: &str,
        body_bytes: usize,
        in_flight: usize,
        history_max: u32,
    ) -> Result<Bench> {
        let options = ConnectOptions {
            url: self.redis_url.clone(),
            prefix: prefix.to_string(),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(60),
            tls_ca_file: None,
        };
        let limits = Limits {
            max_delay_ms: 366 * 24 * 3_600_000,
            max_body_bytes: body_bytes.max(1),
        };
        let store = Store::connect(&options, limits)
            .await
            .context("connecting to Redis")?
            .with_history_max(history_max);
        let mut conn = redis::Client::open(self.redis_url.as_str())
            .context("--redis-url")?
            .get_multiplexed_async_connection()
            .await
            .context("connecting to Redis")?;
        // The client's default (500 ms) fails pipelines of 1,000 scripts on a busy
        // machine; the store above waits as long.
        conn.set_response_timeout(Duration::from_secs(60));
        Ok(Bench {
            store,
            conn,
            body: (0..body_bytes).map(|i| b'a' + (i % 26) as u8).collect(),
            in_flight: in_flight.max(1),
        })
    }
}

fn fresh_prefix(what: &str, detail: &str) -> String {
    let prefix = redisched_testkit::unique("redisched-bench");
    eprintln!("redisched-bench {what}: {detail}, prefix {prefix} (deleted at the end)");
    eprintln!("  interrupted? clean up with: redis-cli --scan --pattern '{prefix}:*' | xargs -r redis-cli unlink");
    prefix
}

fn write_report(out: &std::path::Path, report: &Value) -> Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(out, serde_json::to_string_pretty(report)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

async fn store_bench(mut args: StoreArgs) -> Result<()> {
    if args.quick {
        args.jobs = 20_000;
    }
    if args.jobs == 0 {
        bail!("--jobs must be > 0");
    }
    let target = Target::open(&args.redis_url, args.private_redis).await?;
    let url = url::Url::parse(&target.redis_url).context("--redis-url")?;
    let prefix = fresh_prefix("store", &format!("{} jobs", args.jobs));
    // The main figures run with the default history unless only `off` is asked for.
    let history_max = match args.history {
        HistoryChoice::Off => History::Off.max(),
        HistoryChoice::On | HistoryChoice::Both => History::On.max(),
    };
    let bench = target
        .bench(&prefix, args.body_bytes, args.in_flight, history_max)
        .await?;

    let result = run(&bench, &args, &url, &prefix, target.server_pid()).await;
    eprintln!("cleaning up {prefix}:*");
    let cleanup = bridge::common::delete_prefix(&target.redis_url, &prefix).await;
    let report = result?;
    cleanup.context("cleaning up")?;
    write_report(&args.out, &report)
}

async fn layout_bench(args: LayoutArgs) -> Result<()> {
    let jobs = args
        .jobs
        .unwrap_or(if args.quick { 20_000 } else { 1_000_000 });
    let due_jobs = args
        .due_jobs
        .unwrap_or(if args.quick { 10_000 } else { 100_000 });
    if jobs == 0 || due_jobs == 0 {
        bail!("--jobs and --due-jobs must be > 0");
    }
    // Always private: the study changes a server setting, and its memory deltas must
    // count this run alone.
    let target = Target::open("", true).await?;
    let prefix = fresh_prefix("layout", &format!("{jobs} waiting jobs per side"));
    let bench = target
        .bench(
            &prefix,
            args.body_bytes,
            args.in_flight,
            redisched::store::DEFAULT_HISTORY_MAX,
        )
        .await?;
    let study = layout::Study {
        bench: &bench,
        jobs,
        due_jobs,
        slice: (jobs / 20).clamp(1_000, 50_000),
        rounds: args.runs,
        listpack_value: args.listpack_value,
    };
    let mut report = study.run().await?;
    report["date"] = json!(humantime::format_rfc3339_seconds(SystemTime::now()).to_string());
    report["command"] = json!(std::env::args().collect::<Vec<_>>().join(" "));
    layout::print_table(&report);
    write_report(&args.out, &report)
}

async fn put_cost_bench(args: PutCostArgs) -> Result<()> {
    let jobs = args
        .jobs
        .unwrap_or(if args.quick { 10_000 } else { 100_000 });
    let target = Target::open(&args.redis_url, args.private_redis).await?;
    let prefix = fresh_prefix("put-cost", &format!("{jobs} jobs per side"));
    let bench = target
        .bench(
            &prefix,
            args.body_bytes,
            args.in_flight,
            redisched::store::DEFAULT_HISTORY_MAX,
        )
        .await?;
    let other_put = match &args.other_put {
        Some(path) => Some(
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        ),
        None => None,
    };
    let result = put_cost::compare(
        &bench,
        jobs,
        args.runs,
        target.server_pid(),
        other_put.as_deref(),
    )
    .await;
    let cleanup = bridge::common::delete_prefix(&target.redis_url, &prefix).await;
    let mut report = result?;
    cleanup.context("cleaning up")?;
    report["date"] = json!(humantime::format_rfc3339_seconds(SystemTime::now()).to_string());
    report["command"] = json!(std::env::args().collect::<Vec<_>>().join(" "));
    put_cost::print_table(&report);
    write_report(&args.out, &report)
}

async fn run(
    bench: &Bench,
    args: &StoreArgs,
    url: &url::Url,
    prefix: &str,
    server_pid: Option<u32>,
) -> Result<Value> {
    let n = args.jobs;
    let body = args.body_bytes as u64;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut bench.conn.clone())
        .await?;
    let redis_version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();

    // --- ceilings, same run -------------------------------------------------------
    eprintln!("ceiling: redis-benchmark EVAL \"return 1\"");
    let bench_requests = if args.quick { 100_000 } else { 200_000 };
    let (benchmark_command, eval_ceiling) = redis_benchmark(url, bench_requests)?;
    let drain_jobs = n.min(200_000);
    eprintln!("ceiling: ZADD+HSET script, {drain_jobs} calls pipelined from Rust");
    let zadd_hset = zadd_hset_ceiling(bench, prefix, drain_jobs).await?;

    // --- memory and scale: one topic grown through the sizes ------------------------
    let waiting = Topic::new("bench.waiting")?;
    let keys = bench.store.keys().topic(&waiting).0;
    let mut sizes: Vec<u64> = vec![10_000.min(n), n];
    if args.scale {
        sizes.push(10_000_000.max(n));
    }
    sizes.dedup();
    let probe = 20_000u64.min(n);
    // Waiting jobs are due in 1 to 2 hours, spread so the ZSET is not append-only.
    let later = |i: u64| Due::Delay(3_600_000 + ((i * 7_919) % 3_600_000) as i64);

    let memory_before = bench.used_memory().await?;
    let mut filled = 0u64;
    let mut fill_time = Duration::ZERO;
    let mut memory = Vec::new();
    let mut scale = Vec::new();
    for &size in &sizes {
        eprintln!("filling {waiting} to {size} waiting jobs");
        fill_time += bench
            .put_range(&waiting, "job", filled, size, later)
            .await?;
        filled = size;
        let used = bench.used_memory().await?;
        let delta = used - memory_before;
        let mut key_bytes = 0;
        for key in &keys {
            key_bytes += bench.memory_usage(key, size).await?;
        }
        let per_job = delta as f64 / size as f64;
        memory.push(json!({
            "jobs": size,
            "used_memory_delta": delta,
            "bytes_per_job": per_job,
            "overhead_per_job": per_job - (body as f64 + ID_BYTES as f64),
            "memory_usage_keys_bytes_per_job": key_bytes as f64 / size as f64,
        }));

        // Probe: put `probe` jobs due now beside the waiting ones, reserve them all,
        // release them all. The topic is back to `size` waiting afterwards.
        eprintln!("probe at {size} waiting: {probe} puts, reserves, releases");
        let put = bench
            .put_range(&waiting, "prb", 0, probe, |_| Due::NOW)
            .await?;
        let (moved, reserve, release) = bench.reserve_then_release(&waiting).await?;
        if moved != probe {
            bail!("probe reserved {moved} of {probe} jobs");
        }
        scale.push(json!({
            "waiting": size,
            "probe_jobs": probe,
            "put_us_per_job": micros_per(probe, put),
            "reserve_us_per_job": micros_per(probe, reserve),
            "release_us_per_job": micros_per(probe, release),
        }));
    }
    let put_rate = per_sec(filled, fill_time);

    // --- reserve+release throughput: the bridge's loop over a backlog of due jobs ----
    let due = Topic::new("bench.due")?;
    eprintln!("backlog: {drain_jobs} jobs due now in {due}");
    let put_due = bench
        .put_range(&due, "due", 0, drain_jobs, |_| Due::NOW)
        .await?;
    let (drained, drain_time) = bench.drain(&due, 2, drain_jobs).await?;
    if drained != drain_jobs {
        bail!("drained {drained} of {drain_jobs}");
    }
    let drain_rate = per_sec(drained, drain_time);
    let put_due_rate = per_sec(drain_jobs, put_due);

    // --- history on vs off, alternating in this run ------------------------
    let history_jobs = args
        .history_jobs
        .unwrap_or(if args.quick { 10_000 } else { 100_000 });
    let history = history_compare(bench, args, prefix, history_jobs).await?;

    // --- put.lua beside a bare ZADD+HSET script on the same keys and arguments
    let put_cost_jobs = args
        .put_cost_jobs
        .unwrap_or(if args.quick { 10_000 } else { 100_000 });
    let put_cost = put_cost::compare(bench, put_cost_jobs, args.runs, server_pid, None).await?;

    // --- report ----------------------------------------------------------------------
    let first = &scale[0];
    let last = &scale[scale.len() - 1];
    let ratio = |field: &str| {
        last[field].as_f64().unwrap_or(0.0) / first[field].as_f64().unwrap_or(1.0).max(1e-9)
    };
    let date = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let report = json!({
        "date": date,
        "machine": format!("{cores} cores (shared), Redis {redis_version} on the same host"),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "jobs": n,
        "body_bytes": body,
        "id_bytes": ID_BYTES,
        "put_batch": PUT_BATCH,
        "in_flight": bench.in_flight,
        "ceilings": {
            "redis_benchmark_command": benchmark_command,
            "eval_return_1_per_s": eval_ceiling,
            "zadd_hset_script_per_s": zadd_hset,
        },
        "put_per_s": put_rate,
        "put_due_now_per_s": put_due_rate,
        "reserve_release_per_s": drain_rate,
        "ratios": {
            "put_vs_zadd_hset": put_rate / zadd_hset,
            "put_vs_eval_return_1": put_rate / eval_ceiling,
            "reserve_release_vs_zadd_hset": drain_rate / zadd_hset,
        },
        "memory": memory,
        "scale": scale,
        "scale_ratio_largest_vs_smallest": {
            "put": ratio("put_us_per_job"),
            "reserve": ratio("reserve_us_per_job"),
            "release": ratio("release_us_per_job"),
        },
        "history_max": bench.store.history_max(),
        "history": history,
        "put_cost": put_cost,
        "private_redis": server_pid.is_some(),
    });
    print_table(&report);
    Ok(report)
}

fn print_table(r: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    println!();
    println!(
        "redisched store benchmark — {} — {}",
        r["date"].as_str().unwrap_or(""),
        r["machine"].as_str().unwrap_or("")
    );
    println!(
        "{} jobs waiting, {}-byte bodies, {}-byte ids",
        r["jobs"], r["body_bytes"], r["id_bytes"]
    );
    println!();
    println!("| measure | value | ceiling (same run) | ratio |");
    println!("|---|---:|---:|---:|");
    let c = &r["ceilings"];
    println!(
        "| put, pipelined (jobs/s) | {:.0} | ZADD+HSET script {:.0}/s | {:.2} |",
        f(&r["put_per_s"]),
        f(&c["zadd_hset_script_per_s"]),
        f(&r["ratios"]["put_vs_zadd_hset"])
    );
    println!(
        "| put vs. trivial script | {:.0} | EVAL \"return 1\" {:.0}/s | {:.2} |",
        f(&r["put_per_s"]),
        f(&c["eval_return_1_per_s"]),
        f(&r["ratios"]["put_vs_eval_return_1"])
    );
    println!(
        "| reserve+release, batches of 1000 (jobs/s) | {:.0} | ZADD+HSET script {:.0}/s | {:.2} |",
        f(&r["reserve_release_per_s"]),
        f(&c["zadd_hset_script_per_s"]),
        f(&r["ratios"]["reserve_release_vs_zadd_hset"])
    );
    println!();
    println!("| jobs waiting | Redis bytes/job (INFO used_memory delta) | beyond body+id | MEMORY USAGE of the keys, bytes/job |");
    println!("|---:|---:|---:|---:|");
    for m in r["memory"].as_array().into_iter().flatten() {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} |",
            m["jobs"],
            f(&m["bytes_per_job"]),
            f(&m["overhead_per_job"]),
            f(&m["memory_usage_keys_bytes_per_job"])
        );
    }
    println!();
    println!("| jobs waiting | put µs/job | reserve µs/job | release µs/job |");
    println!("|---:|---:|---:|---:|");
    for s in r["scale"].as_array().into_iter().flatten() {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} |",
            s["waiting"],
            f(&s["put_us_per_job"]),
            f(&s["reserve_us_per_job"]),
            f(&s["release_us_per_job"])
        );
    }
    let s = &r["scale_ratio_largest_vs_smallest"];
    println!();
    println!(
        "cost at the largest vs. smallest size: put {:.2}×, reserve {:.2}×, release {:.2}×",
        f(&s["put"]),
        f(&s["reserve"]),
        f(&s["release"])
    );
    print_history_table(&r["history"]);
    put_cost::print_table(&r["put_cost"]);
}

/// Jobs per turn of one side in the history comparison.
const HISTORY_SLICE: u64 = 10_000;

/// One side of a history round: its store (history cap), topics and summed times.
struct Lane {
    side: History,
    bench: Bench,
    waiting: Topic,
    due: Topic,
    put: Duration,
    drain: Duration,
    moved: u64,
}

/// Put, reserve+release and bytes per one-shot job with the outcome history
/// on (cap 1000) and off (0) in one run: each round puts `jobs` waiting jobs per side
/// and reserves+releases `jobs` due ones, the sides taking turns every
/// [`HISTORY_SLICE`] jobs, beside a fresh ZADD+HSET ceiling. Every side has its own
/// topics, deleted after the round.
async fn history_compare(
    bench: &Bench,
    args: &StoreArgs,
    prefix: &str,
    jobs: u64,
) -> Result<Value> {
    let runs = args.runs.max(1);
    let load_before = bridge::common::load_average();
    let later = |i: u64| Due::Delay(3_600_000 + ((i * 7_919) % 3_600_000) as i64);
    let mut rounds = Vec::new();
    for run in 0..runs {
        let sides = args.history.sides(run);
        eprintln!(
            "history round {}/{runs}: ceiling, then {jobs} jobs per side in slices of {HISTORY_SLICE}, alternating {:?}",
            run + 1,
            sides
        );
        let zadd_hset = zadd_hset_ceiling(bench, prefix, jobs).await?;
        let mut lanes = Vec::new();
        for &side in &sides {
            let name = side.name();
            lanes.push(Lane {
                side,
                bench: Bench {
                    store: bench.store.clone().with_history_max(side.max()),
                    conn: bench.conn.clone(),
                    body: bench.body.clone(),
                    in_flight: bench.in_flight,
                },
                waiting: Topic::new(format!("hist.{name}.{run}.waiting"))?,
                due: Topic::new(format!("hist.{name}.{run}.due"))?,
                put: Duration::ZERO,
                drain: Duration::ZERO,
                moved: 0,
            });
        }
        // Slice by slice, the sides take turns (the first side alternates too), so a
        // change of the shared machine's load hits both sides alike.
        let mut from = 0;
        let mut slice = 0usize;
        while from < jobs {
            let to = (from + HISTORY_SLICE).min(jobs);
            let mut order: Vec<usize> = (0..lanes.len()).collect();
            if slice % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let lane = &mut lanes[i];
                lane.put += lane
                    .bench
                    .put_range(&lane.waiting, "job", from, to, later)
                    .await?;
                lane.bench
                    .put_range(&lane.due, "due", from, to, |_| Due::NOW)
                    .await?;
                let (moved, took) = lane.bench.drain(&lane.due, 2, to - from).await?;
                lane.drain += took;
                lane.moved += moved;
            }
            from = to;
            slice += 1;
        }
        let mut round = json!({ "run": run + 1, "zadd_hset_script_per_s": zadd_hset.round() });
        for lane in &lanes {
            let (b, name) = (&lane.bench, lane.side.name());
            if lane.moved != jobs {
                bail!(
                    "history {name}: reserved and released {} of {jobs}",
                    lane.moved
                );
            }
            let waiting_keys = b.store.keys().all(&lane.waiting);
            let mut key_bytes = 0;
            for key in &waiting_keys {
                key_bytes += b.memory_usage(key, jobs).await?;
            }
            // One-shot puts log nothing (only `replace` of an existing job does).
            let waiting_entries = b.store.stats(&lane.waiting).await?.history;
            if waiting_entries != 0 {
                bail!("history {name}: {waiting_entries} history entries after plain puts, expected none");
            }
            // The history must be what the side claims: full to its cap, or absent.
            let entries = b.store.stats(&lane.due).await?.history;
            let expected = jobs.min(u64::from(lane.side.max()));
            if entries != expected {
                bail!("history {name}: {entries} history entries after {jobs} releases, expected {expected}");
            }
            let due_keys = b.store.keys().all(&lane.due);
            let history_bytes = b.memory_usage(&due_keys[6], entries).await?;
            let put_rate = per_sec(jobs, lane.put);
            let drain_rate = per_sec(lane.moved, lane.drain);
            round[name] = json!({
                "history_max": lane.side.max(),
                "put_per_s": put_rate.round(),
                "reserve_release_per_s": drain_rate.round(),
                "put_vs_zadd_hset": put_rate / zadd_hset,
                "reserve_release_vs_zadd_hset": drain_rate / zadd_hset,
                "bytes_per_job_memory_usage": key_bytes as f64 / jobs as f64,
                "history_entries_after_releases": entries,
                "history_list_bytes": history_bytes,
            });
            let mut unlink = redis::cmd("UNLINK");
            for key in waiting_keys.iter().chain(due_keys.iter()) {
                unlink.arg(key);
            }
            let _: u64 = unlink.query_async(&mut bench.conn.clone()).await?;
        }
        eprintln!(
            "  round {}: put on/off {:.3}, reserve+release on/off {:.3}",
            run + 1,
            round["on"]["put_per_s"].as_f64().unwrap_or(f64::NAN)
                / round["off"]["put_per_s"].as_f64().unwrap_or(f64::NAN),
            round["on"]["reserve_release_per_s"]
                .as_f64()
                .unwrap_or(f64::NAN)
                / round["off"]["reserve_release_per_s"]
                    .as_f64()
                    .unwrap_or(f64::NAN),
        );
        rounds.push(round);
    }
    let load_after = bridge::common::load_average();

    // Medians over the rounds; the on/off ratios are paired within each round.
    let series = |side: &str, field: &str| -> Vec<f64> {
        rounds
            .iter()
            .filter_map(|r| r[side][field].as_f64())
            .collect()
    };
    let paired = |field: &str| -> Vec<f64> {
        rounds
            .iter()
            .filter_map(|r| Some(r["on"][field].as_f64()? / r["off"][field].as_f64()?))
            .collect()
    };
    let spread = |values: Vec<f64>, decimals: i32| {
        Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals))
    };
    let mut sides = json!({});
    for side in ["on", "off"] {
        if rounds.iter().any(|r| r[side].is_object()) {
            sides[side] = json!({
                "put_per_s": spread(series(side, "put_per_s"), 0),
                "reserve_release_per_s": spread(series(side, "reserve_release_per_s"), 0),
                "put_vs_zadd_hset": spread(series(side, "put_vs_zadd_hset"), 3),
                "reserve_release_vs_zadd_hset": spread(series(side, "reserve_release_vs_zadd_hset"), 3),
                "bytes_per_job_memory_usage": spread(series(side, "bytes_per_job_memory_usage"), 1),
                "history_list_bytes": spread(series(side, "history_list_bytes"), 0),
            });
        }
    }
    let ratios = json!({
        "put": spread(paired("put_per_s"), 3),
        "reserve_release": spread(paired("reserve_release_per_s"), 3),
        "bytes_per_job": spread(paired("bytes_per_job_memory_usage"), 3),
    });
    Ok(json!({
        "choice": format!("{:?}", args.history).to_lowercase(),
        "jobs_per_side": jobs,
        "runs": runs,
        "order": "the sides take turns every slice_jobs (put, then reserve+release); the first side alternates by slice and by round",
        "slice_jobs": HISTORY_SLICE,
        "zadd_hset_script_per_s": spread(rounds.iter().filter_map(|r| r["zadd_hset_script_per_s"].as_f64()).collect(), 0),
        "sides": sides,
        "ratio_on_off": ratios,
        "load_average": { "before": load_before, "after": load_after },
        "rounds": rounds,
    }))
}

fn print_history_table(h: &Value) {
    if !h.is_object() {
        return;
    }
    use bridge::common::spread_text;
    let s = &h["sides"];
    println!();
    println!(
        "history on (cap 1000) vs off (0), {} rounds alternating, {} jobs per side and round; load average before {} after {}",
        h["runs"], h["jobs_per_side"], h["load_average"]["before"], h["load_average"]["after"]
    );
    println!("median (min–max) | history on | history off | ratio on/off (paired per round) |");
    println!("|---|---:|---:|---:|");
    let row = |label: &str, field: &str, decimals: usize, ratio: Option<&str>| {
        println!(
            "| {label} | {} | {} | {} |",
            spread_text(&s["on"][field], decimals),
            spread_text(&s["off"][field], decimals),
            ratio.map_or("-".into(), |r| spread_text(&h["ratio_on_off"][r], 3))
        );
    };
    row(
        "put, one-shot, due in 1–2 h (jobs/s)",
        "put_per_s",
        0,
        Some("put"),
    );
    row("put / ZADD+HSET script", "put_vs_zadd_hset", 3, None);
    row(
        "reserve+release, 2 workers, batches of 1000 (jobs/s)",
        "reserve_release_per_s",
        0,
        Some("reserve_release"),
    );
    row(
        "reserve+release / ZADD+HSET script",
        "reserve_release_vs_zadd_hset",
        3,
        None,
    );
    row(
        "bytes per one-shot job (MEMORY USAGE of the topic's keys / jobs)",
        "bytes_per_job_memory_usage",
        1,
        Some("bytes_per_job"),
    );
    row(
        "history list per topic after the releases (MEMORY USAGE, bytes)",
        "history_list_bytes",
        0,
        None,
    );
    println!(
        "ZADD+HSET script ceiling per round: {}",
        spread_text(&h["zadd_hset_script_per_s"], 0)
    );
}

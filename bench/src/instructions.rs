//! Instructions the bridge process executes per ingested command and per dispatched job,
//! counted by `valgrind --tool=callgrind` (an instruction count does not depend on the
//! machine's load the way CPU time does), with Redis's own time per script call from
//! `INFO commandstats` in the same run, and `put.lua` beside a bare ZADD+HSET script.
//!
//! One run: a private `redis-server` (so `INFO commandstats` counts this run alone), a
//! release `redisched run` under callgrind, and six phases, each ended by
//! `callgrind_control --dump` (a dump holds what ran since the previous one):
//!
//! 1. `startup`: until the commands queue has its consumer, plus a settling second;
//! 2. `idle`: [`IDLE`] of nothing, for the time-driven cost (requeue sweeps, probes);
//! 3. `ingest_n`: N put commands (20 B id, 100 B body, delay 0) into topic `a`, which
//!    is paused, so nothing dispatches, until all are applied and acked;
//! 4. `ingest_2n`: 2N put commands into the paused topic `b`;
//! 5. `dispatch_n`: topic `a` resumed, until its N jobs are published, confirmed and
//!    released (the bench consumes them from a queue bound to the ready exchange);
//! 6. `dispatch_2n`: topic `b` resumed, its 2N jobs.
//!
//! Per command and per job are *marginal* costs: (phase with 2N − phase with N) / N.
//! What a phase costs once, whatever its size (the first batch's warm-up, the resume,
//! waking the loops, the bench's 20 ms polling tail), cancels out; the time-driven cost
//! is shown beside it as the idle phase's rate. `--toggle-collect` on the stage's
//! functions was not used: most of a command's cost is outside the ingest task's own
//! polls (lapin's reader and frame parsing, the Redis connection's driver task, the
//! runtime), and that is exactly the cost to count.
//!
//! The callgrind files are kept (`--callgrind-dir`) for `callgrind_annotate`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use clap::Args;
use lapin::types::{AMQPValue, FieldTable};
use redis::aio::MultiplexedConnection;
use redisched_testkit::ChildBridge;
use serde_json::{json, Value};

use crate::bridge::common::{self, Cleanup, Env, Spread};
use crate::private_redis::PrivateRedis;

/// The idle phase: long enough to see the time-driven cost (one requeue sweep a second).
const IDLE: Duration = Duration::from_secs(5);

#[derive(Args, Clone)]
pub(crate) struct InstructionsArgs {
    /// N: put commands of the first ingest phase and jobs of the first dispatch phase
    /// (the second phases take 2N).
    #[arg(long, default_value_t = 2000)]
    commands: u64,
    /// Bridge runs under callgrind (medians need >= 3).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Body size of every command.
    #[arg(long, default_value_t = 100)]
    body_bytes: usize,
    /// Puts per side and round of the put.lua vs bare script comparison (0: skip it).
    #[arg(long, default_value_t = 20_000)]
    put_cost_jobs: u64,
    /// Rounds of the put.lua vs bare script comparison.
    #[arg(long, default_value_t = 3)]
    put_cost_runs: usize,
    /// Where the callgrind files go (one per phase and run).
    #[arg(long, default_value = "artifacts/callgrind")]
    callgrind_dir: PathBuf,
    /// JSON report.
    #[arg(long, default_value = "artifacts/bench-instructions.json")]
    out: PathBuf,
    #[arg(
        long,
        env = "REDISCHED_AMQP__URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// The `redisched` binary to run under callgrind [default: beside this executable;
    /// build it with `cargo build --release -p redisched`].
    #[arg(long)]
    bridge_bin: Option<PathBuf>,
}

const PHASES: [&str; 6] = [
    "startup",
    "idle",
    "ingest_n",
    "ingest_2n",
    "dispatch_n",
    "dispatch_2n",
];

/// What one phase took: instructions (callgrind's Ir), wall seconds, and every Redis
/// command's calls and µs (`INFO commandstats`) in it.
struct Phase {
    instructions: u64,
    seconds: f64,
    redis: BTreeMap<String, (u64, u64)>,
}

pub(crate) async fn run(args: InstructionsArgs) -> Result<()> {
    let started = SystemTime::now();
    let load_start = common::load_average();
    std::fs::create_dir_all(&args.callgrind_dir)
        .with_context(|| format!("create {}", args.callgrind_dir.display()))?;
    let mut runs = Vec::new();
    for run in 1..=args.runs.max(1) {
        eprintln!(
            "instructions run {run}/{}: N = {} (callgrind files in {})",
            args.runs,
            args.commands,
            args.callgrind_dir.display()
        );
        runs.push(one_run(&args, run).await?);
    }
    let mut report = summarize(&args, &runs);
    if args.put_cost_jobs > 0 {
        report["put_cost"] = put_cost(&args).await?;
    }
    report["date"] = json!(humantime::format_rfc3339_seconds(started).to_string());
    report["finished"] = json!(humantime::format_rfc3339_seconds(SystemTime::now()).to_string());
    report["command"] = json!(std::env::args().collect::<Vec<_>>().join(" "));
    report["commit"] = json!(git_commit());
    report["load_average"] = json!({ "start": load_start, "end": common::load_average() });
    report["runs"] = json!(runs);
    print_table(&report);
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", args.out.display()))?;
    println!("\nwrote {}", args.out.display());
    Ok(())
}

async fn one_run(args: &InstructionsArgs, run: usize) -> Result<Value> {
    let redis = PrivateRedis::start().await?;
    let env = Env::new(redis.url(), args.amqp_url.clone(), args.bridge_bin.clone())?;
    let mut config = common::bench_config(&env, "instructions");
    // Everything runs some 50 times slower under callgrind: no Redis link may count as
    // dead meanwhile (a reconnect would be counted as the stage's cost).
    config.redis.connect_timeout_ms = 60_000;
    config.redis.response_timeout_ms = 60_000;
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    let sink_queue = format!("{name}.sink");
    cleanup.queues.push(sink_queue.clone());
    let result = measure(args, run, &env, &config, &redis, &sink_queue).await;
    cleanup.run().await;
    result
}

async fn measure(
    args: &InstructionsArgs,
    run: usize,
    env: &Env,
    config: &redisched::config::Config,
    redis: &PrivateRedis,
    sink_queue: &str,
) -> Result<Value> {
    let n = args.commands;
    let connection = common::amqp(&env.amqp_url).await?;
    let setup = connection.create_channel().await?;
    redisched::amqp::declare_topology(&setup, &config.amqp).await?;
    common::durable_queue(
        &setup,
        sink_queue,
        &config.amqp.ready_exchange,
        FieldTable::default(),
    )
    .await?;
    let store = common::store(config).await?;
    let conn = redis.connect().await?;
    let topics = [common::topic("a")?, common::topic("b")?];
    for topic in &topics {
        store.pause(topic).await?;
    }
    let sink = common::sink(&connection, sink_queue, false).await?;

    let out = args
        .callgrind_dir
        .canonicalize()
        .unwrap_or_else(|_| args.callgrind_dir.clone())
        .join(format!("run{run}"));
    let child = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}.%p", out.display()))
        .arg(&env.bridge_bin)
        .arg("run")
        .envs(config.to_env())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start valgrind (Debian package valgrind)")?;
    let mut bridge = ChildBridge { child };
    let pid = bridge.pid();

    let mut phases: Vec<Phase> = Vec::new();
    let mut mark = Instant::now();
    let mut stats_before = commandstats(&conn).await?;
    let mut end_phase = |label: &str, stats: BTreeMap<String, (u64, u64)>| -> Result<Phase> {
        let seconds = mark.elapsed().as_secs_f64();
        let instructions = dump(pid, &out, phases_done(&out, pid), label)?;
        mark = Instant::now();
        let redis = stats
            .iter()
            .map(|(k, (calls, usec))| {
                let (c0, u0) = stats_before.get(k).copied().unwrap_or((0, 0));
                (k.clone(), (calls - c0, usec - u0))
            })
            .filter(|(_, (calls, _))| *calls > 0)
            .collect();
        stats_before = stats;
        Ok(Phase {
            instructions,
            seconds,
            redis,
        })
    };

    // 1. startup
    common::wait_until(
        "the bridge's consumer",
        Duration::from_secs(300),
        || async {
            if let Some(status) = bridge_exited(pid) {
                bail!("the bridge under valgrind exited early: {status}");
            }
            Ok(common::queue_consumers(&setup, &config.amqp.commands_queue).await? > 0)
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    phases.push(end_phase("startup", commandstats(&conn).await?)?);
    // 2. idle
    tokio::time::sleep(IDLE).await;
    phases.push(end_phase("idle", commandstats(&conn).await?)?);
    // 3, 4. ingest
    let body = common::body(args.body_bytes);
    let publisher = connection.create_channel().await?;
    for (k, count) in [(0usize, n), (1, 2 * n)] {
        let topic = &topics[k];
        let routing = topic.as_str().to_string();
        common::publish_confirmed(
            &publisher,
            &config.amqp.commands_exchange,
            count,
            1000,
            "",
            |i| {
                let id = common::job_id("job", i);
                let props = common::command_props(
                    &id,
                    &[(redisched::amqp::headers::DELAY, AMQPValue::LongLongInt(0))],
                );
                (routing.clone(), props, body.clone())
            },
        )
        .await?;
        let queue = &config.amqp.commands_queue;
        common::wait_until("commands applied", Duration::from_secs(900), || async {
            Ok(store.stats(topic).await?.records >= count
                && common::queue_depth(&setup, queue).await? == 0)
        })
        .await?;
        phases.push(end_phase(PHASES[2 + k], commandstats(&conn).await?)?);
        eprintln!(
            "  {}: {} instructions in {:.1} s",
            PHASES[2 + k],
            phases[phases.len() - 1].instructions,
            phases[phases.len() - 1].seconds
        );
    }
    // 5, 6. dispatch
    let mut expected = 0;
    for (k, count) in [(0usize, n), (1, 2 * n)] {
        let topic = &topics[k];
        expected += count;
        store.resume(topic).await?;
        common::wait_until("jobs dispatched", Duration::from_secs(900), || async {
            Ok(sink.count.load(Ordering::Relaxed) >= expected
                && store.stats(topic).await?.records == 0)
        })
        .await?;
        phases.push(end_phase(PHASES[4 + k], commandstats(&conn).await?)?);
        eprintln!(
            "  {}: {} instructions in {:.1} s",
            PHASES[4 + k],
            phases[phases.len() - 1].instructions,
            phases[phases.len() - 1].seconds
        );
    }
    let delivered = sink.count.load(Ordering::Relaxed);
    sink.stop().await;
    match bridge.terminate(Duration::from_secs(120))? {
        Some(_) => {}
        None => bail!("the bridge under valgrind did not stop within 120 s of SIGTERM"),
    }
    let _ = connection.close(200, "bye".into()).await;
    if delivered != 3 * n {
        bail!("{delivered} jobs delivered, {} expected", 3 * n);
    }

    let per = |a: usize, b: usize| -> f64 {
        (phases[b].instructions as f64 - phases[a].instructions as f64) / n as f64
    };
    let idle_per_s = phases[1].instructions as f64 / phases[1].seconds;
    let mut phase_json = json!({});
    for (label, phase) in PHASES.iter().zip(&phases) {
        phase_json[*label] = json!({
            "instructions": phase.instructions,
            "seconds": common::round2(phase.seconds),
            "redis": phase.redis.iter().map(|(k, (c, u))| (k.clone(), json!({ "calls": c, "usec": u }))).collect::<serde_json::Map<_, _>>(),
        });
    }
    let redis_marginal = |a: usize, b: usize, command: &str| -> Value {
        let get = |i: usize| phases[i].redis.get(command).copied().unwrap_or((0, 0));
        let ((ca, _), (cb, ub)) = (get(a), get(b));
        let calls = cb as f64 - ca as f64;
        // µs are too coarse and noisy for a difference of two phases: per item and per
        // call are read from the 2N phase alone.
        json!({
            "calls_per_item": calls / n as f64,
            "usec_per_item": ub as f64 / (2 * n) as f64,
            "usec_per_call": if cb > 0 { ub as f64 / cb as f64 } else { 0.0 },
        })
    };
    Ok(json!({
        "run": run,
        "n": n,
        "callgrind_files": out.display().to_string(),
        "instructions_per_command": per(2, 3),
        "instructions_per_job": per(4, 5),
        "idle_instructions_per_s": idle_per_s,
        "redis_evalsha_ingest": redis_marginal(2, 3, "evalsha"),
        "redis_evalsha_dispatch": redis_marginal(4, 5, "evalsha"),
        "phases": phase_json,
    }))
}

/// Whether the child already exited (reads /proc: the pid is ours until reaped).
fn bridge_exited(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let state = stat.rsplit(')').next()?.split_whitespace().next()?;
    (state == "Z").then(|| "exited".to_string())
}

/// Dumps made so far of this run's file (`<out>.<pid>.<k>`, k from 1).
fn phases_done(out: &Path, pid: u32) -> usize {
    (1..)
        .take_while(|k| dump_file(out, pid, *k).exists())
        .count()
}

fn dump_file(out: &Path, pid: u32, k: usize) -> PathBuf {
    PathBuf::from(format!("{}.{pid}.{k}", out.display()))
}

/// `callgrind_control --dump`, then waits for the new file and reads its total Ir.
fn dump(pid: u32, out: &Path, done: usize, label: &str) -> Result<u64> {
    let status = Command::new("callgrind_control")
        .arg(format!("--dump={label}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .status()
        .context("run callgrind_control")?;
    if !status.success() {
        bail!("callgrind_control --dump failed: {status}");
    }
    let file = dump_file(out, pid, done + 1);
    let started = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(&file) {
            if let Some(total) = text
                .lines()
                .find_map(|l| l.strip_prefix("totals: ").or(l.strip_prefix("summary: ")))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
            {
                return Ok(total);
            }
        }
        if started.elapsed() > Duration::from_secs(120) {
            bail!("no callgrind dump {} within 120 s", file.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every command's (calls, usec) from `INFO commandstats`.
async fn commandstats(conn: &MultiplexedConnection) -> Result<BTreeMap<String, (u64, u64)>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    let mut stats = BTreeMap::new();
    for line in info.lines() {
        let Some((name, fields)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| -> u64 {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(key))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        stats.insert(name.to_string(), (field("calls="), field("usec=")));
    }
    Ok(stats)
}

/// put.lua vs the bare ZADD+HSET script on a private Redis of its own (the store
/// bench's `put-cost` comparison, same keys, arguments and pipelining).
async fn put_cost(args: &InstructionsArgs) -> Result<Value> {
    let target = crate::Target::open("", true).await?;
    let prefix = crate::fresh_prefix("instructions put-cost", "put.lua vs bare");
    let bench = target
        .bench(
            &prefix,
            args.body_bytes,
            4,
            redisched::store::DEFAULT_HISTORY_MAX,
        )
        .await?;
    let result = crate::put_cost::compare(
        &bench,
        args.put_cost_jobs,
        args.put_cost_runs,
        target.server_pid(),
        None,
    )
    .await;
    let _ = common::delete_prefix(&target.redis_url, &prefix).await;
    result
}

fn summarize(args: &InstructionsArgs, runs: &[Value]) -> Value {
    let spread = |key: &str, sub: Option<&str>, decimals: i32| -> Value {
        let values: Vec<f64> = runs
            .iter()
            .filter_map(|r| match sub {
                Some(s) => r[key][s].as_f64(),
                None => r[key].as_f64(),
            })
            .collect();
        let mut out = Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals));
        if let (Some(min), Some(max)) = (
            values.iter().copied().reduce(f64::min),
            values.iter().copied().reduce(f64::max),
        ) {
            if min > 0.0 {
                out["spread_percent"] = json!(common::round2((max - min) / min * 100.0));
            }
        }
        out
    };
    json!({
        "scenario": "instructions",
        "n": args.commands,
        "body_bytes": args.body_bytes,
        "id_bytes": common::job_id("job", 0).len(),
        "method": "marginal: (phase of 2N - phase of N) / N, callgrind Ir of the whole bridge process; see bench/src/instructions.rs",
        "instructions_per_command": spread("instructions_per_command", None, 0),
        "instructions_per_job": spread("instructions_per_job", None, 0),
        "idle_instructions_per_s": spread("idle_instructions_per_s", None, 0),
        "redis_note": "INFO commandstats counts EVALSHA as one command: in the ingest phases almost every call is put.lua (calls per command ~1), in the dispatch phases reserve.lua and release.lua share the figure",
        "redis_put_lua_usec_per_call": spread("redis_evalsha_ingest", Some("usec_per_call"), 2),
        "redis_evalsha_usec_per_command": spread("redis_evalsha_ingest", Some("usec_per_item"), 2),
        "redis_evalsha_calls_per_command": spread("redis_evalsha_ingest", Some("calls_per_item"), 3),
        "redis_evalsha_usec_per_job": spread("redis_evalsha_dispatch", Some("usec_per_item"), 2),
        "redis_evalsha_usec_per_call_dispatch": spread("redis_evalsha_dispatch", Some("usec_per_call"), 2),
        "redis_evalsha_calls_per_job": spread("redis_evalsha_dispatch", Some("calls_per_item"), 3),
    })
}

fn git_commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn print_table(report: &Value) {
    let show = |v: &Value| -> String {
        format!(
            "{} ({}–{}), spread {} %",
            v["median"], v["min"], v["max"], v["spread_percent"]
        )
    };
    println!(
        "\ninstructions of the bridge (callgrind Ir), N = {}",
        report["n"]
    );
    println!(
        "  per ingested command: {}",
        show(&report["instructions_per_command"])
    );
    println!(
        "  per dispatched job:   {}",
        show(&report["instructions_per_job"])
    );
    println!(
        "  idle, per second:     {}",
        show(&report["idle_instructions_per_s"])
    );
    println!(
        "  Redis, ingest: put.lua µs per call {} ({} calls per command)",
        show(&report["redis_put_lua_usec_per_call"]),
        report["redis_evalsha_calls_per_command"]["median"],
    );
    println!(
        "  Redis, dispatch: EVALSHA µs per job {}, per call {} ({} calls per job: reserve.lua + release.lua)",
        show(&report["redis_evalsha_usec_per_job"]),
        show(&report["redis_evalsha_usec_per_call_dispatch"]),
        report["redis_evalsha_calls_per_job"]["median"],
    );
    if report["put_cost"].is_object() {
        crate::put_cost::print_table(&report["put_cost"]);
    }
}

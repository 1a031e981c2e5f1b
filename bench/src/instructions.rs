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
//! `--sink webhook` measures the webhook path instead: 3 to 6 are replaced by
//! `webhook_n` and `webhook_2n`, N and 2N due jobs (loaded by the bench into two paused
//! topics before the bridge starts) resumed one topic after the other and POSTed by a
//! `[[targets]]` entry to a receiver in the bench process, until the receiver got them
//! all and the store is empty; per webhook-delivered job is the same marginal cost.
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

use redisched::job::Due;

use crate::bridge::common::{self, Cleanup, Env, Spread};
use crate::bridge::webhook::{self, Receiver};
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
    /// `amqp`: ingest of put commands and dispatch to the ready exchange; `webhook`:
    /// jobs loaded due (by the bench, paused) and POSTed to a local receiver by a
    /// `[[targets]]` entry.
    #[arg(long, value_enum, default_value_t = SinkChoice::Amqp)]
    sink: SinkChoice,
    /// The webhook target's `max_in_flight` (`--sink webhook`).
    #[arg(long, default_value_t = 64)]
    max_in_flight: usize,
}

/// Which delivery path a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SinkChoice {
    Amqp,
    Webhook,
}

const PHASES: [&str; 6] = [
    "startup",
    "idle",
    "ingest_n",
    "ingest_2n",
    "dispatch_n",
    "dispatch_2n",
];

const WEBHOOK_PHASES: [&str; 4] = ["startup", "idle", "webhook_n", "webhook_2n"];

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
            "instructions run {run}/{} ({:?} sink): N = {} (callgrind files in {})",
            args.runs,
            args.sink,
            args.commands,
            args.callgrind_dir.display()
        );
        runs.push(one_run(&args, run).await?);
    }
    let mut report = summarize(&args, &runs);
    if args.put_cost_jobs > 0 && args.sink == SinkChoice::Amqp {
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

/// What one run measures in: the services, the bridge's config and, for the webhook
/// sink, the receiver and the file holding the target.
struct Setup<'a> {
    env: &'a Env,
    config: &'a redisched::config::Config,
    redis: &'a PrivateRedis,
    sink_queue: &'a str,
    webhook: Option<(&'a Path, &'a Receiver)>,
}

async fn one_run(args: &InstructionsArgs, run: usize) -> Result<Value> {
    let redis = PrivateRedis::start().await?;
    let env = Env::new(
        redis.url(),
        args.amqp_url.clone(),
        args.bridge_bin.clone(),
        &[],
    )?;
    let mut config = common::bench_config(&env, "instructions");
    // Everything runs some 50 times slower under callgrind: no Redis link may count as
    // dead meanwhile (a reconnect would be counted as the stage's cost).
    config.redis.connect_timeout_ms = 60_000;
    config.redis.response_timeout_ms = 60_000;
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    let sink_queue = format!("{name}.sink");
    cleanup.queues.push(sink_queue.clone());
    let result = match args.sink {
        SinkChoice::Amqp => {
            let setup = Setup {
                env: &env,
                config: &config,
                redis: &redis,
                sink_queue: &sink_queue,
                webhook: None,
            };
            measure(args, run, &setup).await
        }
        SinkChoice::Webhook => {
            let receiver = Receiver::start()?;
            let mut hook =
                webhook::target("bench", "hook.*", receiver.url("/hook"), args.max_in_flight);
            // A request answered late under callgrind must not count as failed, nor
            // its job be requeued meanwhile.
            hook.timeout_ms = 60_000;
            config.dispatch.ttr_ms = 120_000;
            config.targets = vec![hook];
            let file = std::env::temp_dir().join(format!("{name}.targets.toml"));
            let written = webhook::write_targets(&config, &file);
            let setup = Setup {
                env: &env,
                config: &config,
                redis: &redis,
                sink_queue: &sink_queue,
                webhook: Some((&file, &receiver)),
            };
            let result = match written {
                Ok(()) => measure(args, run, &setup).await,
                Err(err) => Err(err),
            };
            receiver.stop();
            let _ = std::fs::remove_file(&file);
            result
        }
    };
    cleanup.run().await;
    result
}

/// The phases done so far, each ended by a callgrind dump and an `INFO commandstats`.
struct Recorder<'a> {
    pid: u32,
    out: PathBuf,
    conn: &'a MultiplexedConnection,
    mark: Instant,
    stats_before: BTreeMap<String, (u64, u64)>,
    phases: Vec<Phase>,
}

impl Recorder<'_> {
    async fn end(&mut self, label: &str) -> Result<()> {
        let stats = commandstats(self.conn).await?;
        let seconds = self.mark.elapsed().as_secs_f64();
        let instructions = dump(self.pid, &self.out, phases_done(&self.out, self.pid), label)?;
        self.mark = Instant::now();
        let redis = stats
            .iter()
            .map(|(k, (calls, usec))| {
                let (c0, u0) = self.stats_before.get(k).copied().unwrap_or((0, 0));
                (k.clone(), (calls - c0, usec - u0))
            })
            .filter(|(_, (calls, _))| *calls > 0)
            .collect();
        self.stats_before = stats;
        if label != "startup" && label != "idle" {
            eprintln!("  {label}: {instructions} instructions in {seconds:.1} s");
        }
        self.phases.push(Phase {
            instructions,
            seconds,
            redis,
        });
        Ok(())
    }
}

/// Starts the bridge under callgrind (with the targets' file, if any).
fn spawn_bridge(setup: &Setup<'_>, out: &Path) -> Result<ChildBridge> {
    let mut command = Command::new("valgrind");
    command
        .arg("--tool=callgrind")
        // Names spelled in every dump, so `callgrind_annotate` reads each phase alone.
        .arg("--compress-strings=no")
        .arg(format!("--callgrind-out-file={}.%p", out.display()))
        .arg(&setup.env.bridge_bin);
    if let Some((file, _)) = setup.webhook {
        command.arg("--config").arg(file);
    }
    let child = command
        .arg("run")
        .envs(setup.config.to_env())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start valgrind (Debian package valgrind)")?;
    Ok(ChildBridge { child })
}

async fn measure(args: &InstructionsArgs, run: usize, setup: &Setup<'_>) -> Result<Value> {
    let (config, n) = (setup.config, args.commands);
    let connection = common::amqp(&setup.env.amqp_url).await?;
    let channel = connection.create_channel().await?;
    redisched::amqp::declare_topology(&channel, &config.amqp).await?;
    common::durable_queue(
        &channel,
        setup.sink_queue,
        &config.amqp.ready_exchange,
        FieldTable::default(),
    )
    .await?;
    let store = common::store(config).await?;
    let conn = setup.redis.connect().await?;
    let names = match setup.webhook {
        None => ["a", "b"],
        Some(_) => ["hook.a", "hook.b"],
    };
    let topics = [common::topic(names[0])?, common::topic(names[1])?];
    for topic in &topics {
        store.pause(topic).await?;
    }
    if setup.webhook.is_some() {
        // Loaded by the bench before the bridge starts: only their delivery is counted.
        let body = common::body(args.body_bytes);
        for (topic, count) in topics.iter().zip([n, 2 * n]) {
            common::load_jobs(&store, topic, "job", count, &body, Due::NOW, "load").await?;
        }
    }
    let out = args
        .callgrind_dir
        .canonicalize()
        .unwrap_or_else(|_| args.callgrind_dir.clone())
        .join(format!("run{run}"));
    let mut bridge = spawn_bridge(setup, &out)?;
    let mut rec = Recorder {
        pid: bridge.pid(),
        out: out.clone(),
        conn: &conn,
        mark: Instant::now(),
        stats_before: commandstats(&conn).await?,
        phases: Vec::new(),
    };
    let ctx = Phases {
        args,
        config,
        store: &store,
        topics: &topics,
        channel: &channel,
        sink_queue: setup.sink_queue,
    };
    let outcome = match setup.webhook {
        None => ctx.amqp(&mut rec, &connection).await,
        Some((_, receiver)) => ctx.webhook(&mut rec, receiver).await,
    };
    let stopped = bridge.terminate(Duration::from_secs(120));
    let _ = connection.close(200, "bye".into()).await;
    let delivered = outcome?;
    match stopped? {
        Some(_) => {}
        None => bail!("the bridge under valgrind did not stop within 120 s of SIGTERM"),
    }
    if delivered < 3 * n {
        bail!("{delivered} jobs delivered, {} expected", 3 * n);
    }
    Ok(run_json(run, n, &out, &rec.phases, setup.webhook.is_some()))
}

/// The phases of one run after the bridge started.
struct Phases<'a> {
    args: &'a InstructionsArgs,
    config: &'a redisched::config::Config,
    store: &'a redisched::store::Store,
    topics: &'a [redisched::job::Topic; 2],
    channel: &'a lapin::Channel,
    sink_queue: &'a str,
}

impl Phases<'_> {
    /// Startup (until the commands queue has its consumer, plus a settling second)
    /// and idle.
    async fn start(&self, rec: &mut Recorder<'_>) -> Result<()> {
        let pid = rec.pid;
        let queue = &self.config.amqp.commands_queue;
        common::wait_until(
            "the bridge's consumer",
            Duration::from_secs(300),
            || async {
                if let Some(status) = bridge_exited(pid) {
                    bail!("the bridge under valgrind exited early: {status}");
                }
                Ok(common::queue_consumers(self.channel, queue).await? > 0)
            },
        )
        .await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        rec.end("startup").await?;
        tokio::time::sleep(IDLE).await;
        rec.end("idle").await
    }

    /// Ingest of N and 2N put commands, then their dispatch to the ready exchange;
    /// returns the jobs the bench consumed.
    async fn amqp(&self, rec: &mut Recorder<'_>, connection: &lapin::Connection) -> Result<u64> {
        let (config, n, store) = (self.config, self.args.commands, self.store);
        let sink = common::sink(connection, self.sink_queue, false).await?;
        self.start(rec).await?;
        let body = common::body(self.args.body_bytes);
        let publisher = connection.create_channel().await?;
        for (topic, count) in self.topics.iter().zip([n, 2 * n]) {
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
                        &[(redisched::job::headers::DELAY, AMQPValue::LongLongInt(0))],
                    );
                    (routing.clone(), props, body.clone())
                },
            )
            .await?;
            let queue = &config.amqp.commands_queue;
            common::wait_until("commands applied", Duration::from_secs(900), || async {
                Ok(store.stats(topic).await?.records >= count
                    && common::queue_depth(self.channel, queue).await? == 0)
            })
            .await?;
            rec.end(if count == n { "ingest_n" } else { "ingest_2n" })
                .await?;
        }
        let mut expected = 0;
        for (topic, count) in self.topics.iter().zip([n, 2 * n]) {
            expected += count;
            store.resume(topic).await?;
            common::wait_until("jobs dispatched", Duration::from_secs(900), || async {
                Ok(sink.count.load(Ordering::Relaxed) >= expected
                    && store.stats(topic).await?.records == 0)
            })
            .await?;
            rec.end(if count == n {
                "dispatch_n"
            } else {
                "dispatch_2n"
            })
            .await?;
        }
        let delivered = sink.count.load(Ordering::Relaxed);
        sink.stop().await;
        Ok(delivered)
    }

    /// N and 2N due jobs of paused topics, resumed one after the other, POSTed to the
    /// receiver and released; returns the requests the receiver got.
    async fn webhook(&self, rec: &mut Recorder<'_>, receiver: &Receiver) -> Result<u64> {
        let (n, store) = (self.args.commands, self.store);
        let counted = receiver.count();
        self.start(rec).await?;
        let mut expected = 0;
        for (topic, count) in self.topics.iter().zip([n, 2 * n]) {
            expected += count;
            store.resume(topic).await?;
            common::wait_until("jobs POSTed", Duration::from_secs(900), || async {
                Ok(
                    receiver.count() - counted >= expected
                        && store.stats(topic).await?.records == 0,
                )
            })
            .await?;
            rec.end(if count == n {
                "webhook_n"
            } else {
                "webhook_2n"
            })
            .await?;
        }
        Ok(receiver.count() - counted)
    }
}

/// One run's figures: marginal instructions per item, the idle rate, Redis's share.
fn run_json(run: usize, n: u64, out: &Path, phases: &[Phase], webhook: bool) -> Value {
    let per = |a: usize, b: usize| -> f64 {
        (phases[b].instructions as f64 - phases[a].instructions as f64) / n as f64
    };
    let idle_per_s = phases[1].instructions as f64 / phases[1].seconds;
    let labels: &[&str] = if webhook { &WEBHOOK_PHASES } else { &PHASES };
    let mut phase_json = json!({});
    for (label, phase) in labels.iter().zip(phases) {
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
    let mut figures = json!({
        "run": run,
        "n": n,
        "callgrind_files": out.display().to_string(),
        "idle_instructions_per_s": idle_per_s,
        "phases": phase_json,
    });
    if webhook {
        figures["instructions_per_webhook_job"] = json!(per(2, 3));
        figures["redis_evalsha_webhook"] = redis_marginal(2, 3, "evalsha");
    } else {
        figures["instructions_per_command"] = json!(per(2, 3));
        figures["instructions_per_job"] = json!(per(4, 5));
        figures["redis_evalsha_ingest"] = redis_marginal(2, 3, "evalsha");
        figures["redis_evalsha_dispatch"] = redis_marginal(4, 5, "evalsha");
    }
    figures
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
        "instructions_per_webhook_job": spread("instructions_per_webhook_job", None, 0),
        "sink": format!("{:?}", args.sink).to_lowercase(),
        "idle_instructions_per_s": spread("idle_instructions_per_s", None, 0),
        "redis_note": "INFO commandstats counts EVALSHA as one command: in the ingest phases almost every call is put.lua (calls per command ~1), in the dispatch phases reserve.lua and release.lua share the figure",
        "redis_put_lua_usec_per_call": spread("redis_evalsha_ingest", Some("usec_per_call"), 2),
        "redis_evalsha_usec_per_command": spread("redis_evalsha_ingest", Some("usec_per_item"), 2),
        "redis_evalsha_calls_per_command": spread("redis_evalsha_ingest", Some("calls_per_item"), 3),
        "redis_evalsha_usec_per_job": spread("redis_evalsha_dispatch", Some("usec_per_item"), 2),
        "redis_evalsha_usec_per_call_dispatch": spread("redis_evalsha_dispatch", Some("usec_per_call"), 2),
        "redis_evalsha_calls_per_job": spread("redis_evalsha_dispatch", Some("calls_per_item"), 3),
        "redis_evalsha_usec_per_webhook_job": spread("redis_evalsha_webhook", Some("usec_per_item"), 2),
        "redis_evalsha_calls_per_webhook_job": spread("redis_evalsha_webhook", Some("calls_per_item"), 3),
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
    if report["sink"] == "webhook" {
        println!(
            "  per webhook-delivered job: {}",
            show(&report["instructions_per_webhook_job"])
        );
        println!(
            "  idle, per second:          {}",
            show(&report["idle_instructions_per_s"])
        );
        println!(
            "  Redis: EVALSHA µs per job {} ({} calls per job: reserve.lua + release.lua)",
            show(&report["redis_evalsha_usec_per_webhook_job"]),
            report["redis_evalsha_calls_per_webhook_job"]["median"],
        );
        return;
    }
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

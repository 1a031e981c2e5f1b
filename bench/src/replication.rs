//! `redisched-bench replication`: what `redis.wait_replicas = 1` costs
//! ingest, on a primary that has a replica, beside `wait_replicas = 0` in the same run
//! (the two alternate, `--runs` rounds, so a drift of the shared machine favours
//! neither) and beside the raw Redis floor of the same run.
//!
//! - Throughput: N put commands wait in the queue; timed from the bridge's start until
//!   the store holds them all and the queue is empty (as `ingest`).
//! - Latency: commands published one at a time with `reply_to`, publish to reply. The
//!   bridge replies once a batch counts as applied (with waiting: once the replicas
//!   confirmed it), just before the ack.
//! - Floor: a raw `SET` round trip, and `SET` + `WAIT 1` in one pipeline, on one plain
//!   connection to the same primary.
//!
//! ```text
//! redis-server --port 6390 --save "" --appendonly no --daemonize yes
//! redis-server --port 6391 --save "" --appendonly no --daemonize yes --replicaof 127.0.0.1 6390
//! target/release/redisched-bench replication --redis-url redis://127.0.0.1:6390/0
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use serde_json::{json, Value};

use crate::bridge::common::{self, Bridge, Cleanup, Env, Spread};

#[derive(Args, Clone)]
pub(crate) struct ReplicationArgs {
    /// Put commands per side and round for the throughput figure.
    #[arg(long, default_value_t = 50_000)]
    commands: u64,
    /// Commands published one at a time per side and round for the latency figure.
    #[arg(long, default_value_t = 1_000)]
    probes: u64,
    /// Rounds of wait 0 vs wait 1, alternating which goes first (medians need >= 3).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Body size of every command.
    #[arg(long, default_value_t = 200)]
    body_bytes: usize,
    /// JSON report.
    #[arg(long, default_value = "artifacts/bench-replication.json")]
    out: PathBuf,
    /// A primary with at least one replica.
    #[arg(
        long,
        env = "REDISCHED_REDIS__URL",
        default_value = "redis://127.0.0.1:6379/0"
    )]
    redis_url: String,
    #[arg(
        long,
        env = "REDISCHED_AMQP__URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// The `redisched` binary to run as the bridge [default: beside this executable].
    #[arg(long)]
    bridge_bin: Option<PathBuf>,
}

pub(crate) async fn run(args: ReplicationArgs) -> Result<()> {
    let env = Env::new(
        args.redis_url.clone(),
        args.amqp_url.clone(),
        args.bridge_bin.clone(),
        &[],
    )?;
    let mut floor = redis::Client::open(args.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("connect to Redis at {}", args.redis_url))?;
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut floor)
        .await?;
    if !info.contains("role:master") || info.contains("connected_slaves:0") {
        bail!(
            "{} must be a primary with a replica (see `redisched-bench replication --help`)",
            args.redis_url
        );
    }
    let mut sides: [Vec<Value>; 2] = [Vec::new(), Vec::new()];
    let mut floors = Vec::new();
    for run in 0..args.runs {
        let order: [u32; 2] = if run % 2 == 0 { [0, 1] } else { [1, 0] };
        for wait in order {
            eprintln!(
                "replication: round {} of {}, wait_replicas {wait}",
                run + 1,
                args.runs
            );
            let config = {
                let mut config = common::bench_config(&env, &format!("repl-w{wait}"));
                config.redis.wait_replicas = wait;
                config
            };
            let cleanup = Cleanup::for_config(&config);
            let side = measure(&env, &args, &config).await;
            cleanup.run().await;
            sides[wait as usize].push(side?);
        }
        floors.push(raw_floor(&mut floor, args.probes).await?);
    }

    let spread = |values: Vec<f64>, decimals| {
        Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals))
    };
    let field = |side: &[Value], key: &str| -> Vec<f64> {
        side.iter().filter_map(|v| v[key].as_f64()).collect()
    };
    let summary = |side: &[Value]| {
        json!({
            "commands_per_s": spread(field(side, "commands_per_s"), 0),
            "latency_p50_ms": spread(field(side, "latency_p50_ms"), 2),
            "latency_p99_ms": spread(field(side, "latency_p99_ms"), 2),
        })
    };
    let ratios: Vec<f64> = sides[0]
        .iter()
        .zip(&sides[1])
        .filter_map(|(off, on)| {
            Some(on["commands_per_s"].as_f64()? / off["commands_per_s"].as_f64()?)
        })
        .collect();
    let report = json!({
        "scenario": "replication",
        "date": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        "load_average_after": common::load_average(),
        "commands": args.commands,
        "probes": args.probes,
        "runs": args.runs,
        "body_bytes": args.body_bytes,
        "wait_0": summary(&sides[0]),
        "wait_1": summary(&sides[1]),
        "throughput_ratio_wait_1_to_0": spread(ratios, 3),
        "floor": {
            "what": "one plain connection to the primary: SET, and SET + WAIT 1 in one pipeline",
            "set_p50_ms": spread(field(&floors, "set_p50_ms"), 3),
            "set_wait_p50_ms": spread(field(&floors, "set_wait_p50_ms"), 3),
            "set_wait_p99_ms": spread(field(&floors, "set_wait_p99_ms"), 3),
        },
        "rounds": { "wait_0": sides[0], "wait_1": sides[1], "floor": floors },
    });
    let text = |path: &str, decimals| {
        common::spread_text(
            &report.pointer(path).cloned().unwrap_or(Value::Null),
            decimals,
        )
    };
    eprintln!(
        "\nreplication, median (min–max) of {} rounds:\n  \
         ingest commands/s:      wait 0: {}   wait 1: {}   ratio {}\n  \
         command latency p50 ms: wait 0: {}   wait 1: {}\n  \
         command latency p99 ms: wait 0: {}   wait 1: {}\n  \
         floor p50 ms:           SET {}   SET + WAIT 1 {}",
        args.runs,
        text("/wait_0/commands_per_s", 0),
        text("/wait_1/commands_per_s", 0),
        text("/throughput_ratio_wait_1_to_0", 3),
        text("/wait_0/latency_p50_ms", 2),
        text("/wait_1/latency_p50_ms", 2),
        text("/wait_0/latency_p99_ms", 2),
        text("/wait_1/latency_p99_ms", 2),
        text("/floor/set_p50_ms", 3),
        text("/floor/set_wait_p50_ms", 3),
    );
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// One side of one round: throughput, then latency, on one bridge.
async fn measure(
    env: &Env,
    args: &ReplicationArgs,
    config: &redisched::config::Config,
) -> Result<Value> {
    let n = args.commands;
    let connection = common::amqp(&env.amqp_url).await?;
    let setup = connection.create_channel().await?;
    redisched::amqp::declare_topology(&setup, &config.amqp).await?;
    let store = common::store(config).await?;
    let topic = common::topic("bench")?;
    let body = common::body(args.body_bytes);
    let later = [(
        redisched::job::headers::DELAY,
        AMQPValue::LongLongInt(3_600_000),
    )];
    let publisher = connection.create_channel().await?;
    common::publish_confirmed(
        &publisher,
        &config.amqp.commands_exchange,
        n,
        1000,
        "publish commands",
        |i| {
            let props = common::command_props(&common::job_id("job", i), &later);
            ("bench".to_string(), props, body.clone())
        },
    )
    .await?;

    let mut bridge = Bridge::start(env, config)?;
    let started = bridge.started;
    loop {
        let records = store.stats(&topic).await?.records;
        if records >= n && common::queue_depth(&setup, &config.amqp.commands_queue).await? == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(900) {
            bail!("only {records} of {n} commands applied after 900 s");
        }
        bridge.check_alive()?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    let rate = common::per_sec(n, elapsed);
    eprintln!("  throughput: {rate:.0} commands/s");

    // Latency: one command at a time, publish to reply.
    let replies = format!("{}.replies", config.redis.prefix);
    let listener = connection.create_channel().await?;
    listener
        .queue_declare(
            replies.as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let mut consumer = listener
        .basic_consume(
            replies.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let mut latencies = Vec::with_capacity(args.probes as usize);
    for i in 0..args.probes {
        let props = common::command_props(&common::job_id("probe", i), &later)
            .with_reply_to(ShortString::from(replies.as_str()))
            .with_correlation_id(ShortString::from(i.to_string()));
        let sent = Instant::now();
        let _confirm = publisher
            .basic_publish(
                config.amqp.commands_exchange.as_str().into(),
                "bench".into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await?;
        let reply = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .context("no reply within 10 s")?
            .context("reply consumer ended")??;
        let elapsed = sent.elapsed();
        let echoed = reply
            .properties
            .correlation_id()
            .as_ref()
            .map(|c| c.to_string());
        if echoed.as_deref() != Some(i.to_string().as_str()) {
            bail!("reply {echoed:?} to probe {i}");
        }
        latencies.push(elapsed.as_secs_f64() * 1000.0);
    }
    let latency = Percentiles::of(&mut latencies);
    eprintln!(
        "  latency: p50 {:.2} ms, p99 {:.2} ms",
        latency.p50, latency.p99
    );
    bridge.stop()?;
    let _ = connection.close(200, "bye".into()).await;
    Ok(json!({
        "wait_replicas": config.redis.wait_replicas,
        "seconds": common::round2(elapsed.as_secs_f64()),
        "commands_per_s": rate.round(),
        "latency_p50_ms": latency.p50,
        "latency_p99_ms": latency.p99,
        "latency_max_ms": latency.max,
    }))
}

/// The raw cost of waiting on this primary: `probes` round trips of `SET`, and of `SET`
/// + `WAIT 1 1000` in one pipeline, alternating, on one connection.
async fn raw_floor(conn: &mut redis::aio::MultiplexedConnection, probes: u64) -> Result<Value> {
    let key = format!("{}:floor", common::unique("repl"));
    let (mut set, mut set_wait) = (Vec::new(), Vec::new());
    for i in 0..probes {
        let started = Instant::now();
        let () = redis::cmd("SET").arg(&key).arg(i).query_async(conn).await?;
        set.push(started.elapsed().as_secs_f64() * 1000.0);
        let started = Instant::now();
        let (_, acked): ((), i64) = redis::pipe()
            .cmd("SET")
            .arg(&key)
            .arg(i)
            .cmd("WAIT")
            .arg(1)
            .arg(1000)
            .query_async(conn)
            .await?;
        set_wait.push(started.elapsed().as_secs_f64() * 1000.0);
        if acked < 1 {
            bail!("the replica did not confirm a SET within 1 s");
        }
    }
    let _: i64 = redis::cmd("DEL").arg(&key).query_async(conn).await?;
    let (set, set_wait) = (Percentiles::of(&mut set), Percentiles::of(&mut set_wait));
    Ok(json!({
        "set_p50_ms": set.p50,
        "set_wait_p50_ms": set_wait.p50,
        "set_wait_p99_ms": set_wait.p99,
    }))
}

/// Nearest-rank percentiles of samples in ms, unrounded (the floor is tens of µs).
struct Percentiles {
    p50: f64,
    p99: f64,
    max: f64,
}

impl Percentiles {
    fn of(values: &mut [f64]) -> Self {
        values.sort_by(|a, b| a.total_cmp(b));
        let sorted: &[f64] = values;
        let rank = |p: f64| redisched_testkit::percentile(sorted, p);
        Self {
            p50: rank(0.50),
            p99: rank(0.99),
            max: values.last().copied().unwrap_or(0.0),
        }
    }
}

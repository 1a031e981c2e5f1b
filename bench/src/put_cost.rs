//! What `put.lua` costs next to the least a scheduler on Redis must do per job
//! (one ZADD and one HSET in a script), measured so that only the scripts differ.
//!
//! Three sides take turns every [`SLICE`] jobs, each into its own topic:
//! - `bare`: `EVALSHA` of `ZADD KEYS[1] ARGV[6] ARGV[1]; HSET KEYS[3] ARGV[1] ARGV[2]`;
//! - `put_lua`: `EVALSHA put.lua`;
//! - `store`: `Store::apply`, the product's whole path (argument building, the topic
//!   registration, reply decoding);
//! - `put_lua_other` (with `--other-put FILE`): another version of put.lua, e.g. the
//!   previous release's, to compare two versions in one run.
//!
//! `bare` and `put_lua` get the very same KEYS (the topic's eight) and ARGV (the eleven
//! `Store::apply` sends), in pipelines built before the clock starts, `PUT_BATCH` calls
//! each and `in_flight` at once on one connection, and their replies are read the same
//! way; `store` builds its pipelines while timed, as the bridge does. Besides the rates,
//! the bench's own CPU per call, and on a private Redis (`--private-redis`) the server's
//! CPU per call and `INFO commandstats`' EVALSHA µs per call (the scripts' run time),
//! which no other client disturbs there.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use futures_util::{stream, StreamExt};
use redis::Value as Reply;
use redisched::job::{Due, Topic};
use redisched::store::SCRIPT_SOURCES;
use serde_json::{json, Value};

use crate::bridge::common::{cpu_seconds, load_average, spread_text, Spread};
use crate::private_redis::{ServerMark, ServerTime};
use crate::{job_id, Bench, PUT_BATCH};

/// Jobs per turn of one side.
pub(crate) const SLICE: u64 = 10_000;

/// The least a scheduler on Redis does per job, on the put's own keys and arguments.
const BARE_SCRIPT: &str =
    "redis.call('ZADD', KEYS[1], ARGV[6], ARGV[1]) redis.call('HSET', KEYS[3], ARGV[1], ARGV[2]) return 1";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Bare,
    PutLua,
    Store,
    PutOther,
}

impl Side {
    const ALL: [Side; 4] = [Side::Bare, Side::PutLua, Side::Store, Side::PutOther];

    fn name(self) -> &'static str {
        match self {
            Side::Bare => "bare",
            Side::PutLua => "put_lua",
            Side::Store => "store",
            Side::PutOther => "put_lua_other",
        }
    }
}

/// One side of a round: its topic and what it took.
struct Lane {
    side: Side,
    topic: Topic,
    /// Prebuilt pipelines (raw sides), one per batch.
    pipes: Vec<redis::Pipeline>,
    wall: Duration,
    bench_cpu: f64,
    server: ServerTime,
}

/// Waiting jobs are due in 1 to 2 hours, spread so the ZSET is not append-only (as in
/// the store bench).
fn delay_of(n: u64) -> i64 {
    3_600_000 + ((n * 7_919) % 3_600_000) as i64
}

/// The eleven arguments `Store::apply` gives `put.lua` for a one-shot `nx` put.
fn put_args(bench: &Bench, n: u64) -> Result<Vec<Vec<u8>>> {
    let limits = bench.store.limits();
    Ok(vec![
        job_id("job", n)?.as_str().as_bytes().to_vec(),
        bench.body.clone(),
        Vec::new(),
        b"nx".to_vec(),
        b"delay".to_vec(),
        delay_of(n).to_string().into_bytes(),
        limits.max_delay_ms.to_string().into_bytes(),
        limits.max_body_bytes.to_string().into_bytes(),
        bench.store.keys().notify_channel().into_bytes(),
        Vec::new(),
        bench.store.history_max().to_string().into_bytes(),
    ])
}

fn raw_pipes(bench: &Bench, sha: &str, topic: &Topic, jobs: u64) -> Result<Vec<redis::Pipeline>> {
    let keys = bench.store.keys().all(topic);
    let mut pipes = Vec::new();
    let mut start = 0;
    while start < jobs {
        let end = (start + PUT_BATCH as u64).min(jobs);
        let mut pipe = redis::pipe();
        for n in start..end {
            let cmd = pipe.cmd("EVALSHA").arg(sha).arg(keys.len()).arg(&keys[..]);
            for arg in put_args(bench, n)? {
                cmd.arg(arg);
            }
        }
        pipes.push(pipe);
        start = end;
    }
    Ok(pipes)
}

/// Runs the pipelines `from..to` (batch indexes), `in_flight` at once, and checks each
/// reply: `bare` answers 1, `put.lua` `{'scheduled', due}`.
async fn run_pipes(bench: &Bench, side: Side, pipes: &[redis::Pipeline]) -> Result<()> {
    let mut results = stream::iter(pipes.iter().map(|pipe| {
        let mut conn = bench.conn.clone();
        async move { pipe.query_async::<Vec<Reply>>(&mut conn).await }
    }))
    .buffer_unordered(bench.in_flight);
    while let Some(result) = results.next().await {
        for reply in result? {
            let fine = match (side, &reply) {
                (Side::Bare, Reply::Int(1)) => true,
                (Side::PutLua | Side::PutOther, Reply::Array(items)) => {
                    matches!(items.first(), Some(Reply::BulkString(s)) if s == b"scheduled")
                }
                _ => false,
            };
            if !fine {
                bail!("{}: unexpected reply {reply:?}", side.name());
            }
        }
    }
    Ok(())
}

/// `rounds` rounds of `jobs` puts per side, the sides taking turns every [`SLICE`]
/// (the first side rotates by slice and by round). `server_pid`: the private Redis, whose
/// CPU and command statistics are then the bench's alone. `other_put`: the source of
/// another put.lua to run as a fourth side.
pub(crate) async fn compare(
    bench: &Bench,
    jobs: u64,
    rounds: usize,
    server_pid: Option<u32>,
    other_put: Option<&str>,
) -> Result<Value> {
    let bare = redis::Script::new(BARE_SCRIPT);
    let mut conn = bench.conn.clone();
    let bare_sha: String = bare.prepare_invoke().load_async(&mut conn).await?;
    let put_source = SCRIPT_SOURCES
        .iter()
        .find(|(name, _)| *name == "put")
        .map(|(_, source)| *source)
        .unwrap_or_default();
    let put_sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(put_source)
        .query_async(&mut conn)
        .await?;
    let other_sha: Option<String> = match other_put {
        Some(source) => Some(
            redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(source)
                .query_async(&mut conn)
                .await?,
        ),
        None => None,
    };
    let sides: Vec<Side> = Side::ALL
        .into_iter()
        .filter(|side| *side != Side::PutOther || other_sha.is_some())
        .collect();
    let me = std::process::id();
    let load_before = load_average();
    let mut results = Vec::new();
    for round in 0..rounds.max(1) {
        eprintln!(
            "put cost round {}/{rounds}: {jobs} jobs per side (bare, put.lua, Store::apply), slices of {SLICE}",
            round + 1
        );
        let mut lanes = Vec::new();
        for &side in &sides {
            let topic = Topic::new(format!("cost.{}.{round}", side.name()))?;
            let pipes = match (side, &other_sha) {
                (Side::Bare, _) => raw_pipes(bench, &bare_sha, &topic, jobs)?,
                (Side::PutLua, _) => raw_pipes(bench, &put_sha, &topic, jobs)?,
                (Side::PutOther, Some(sha)) => raw_pipes(bench, sha, &topic, jobs)?,
                _ => Vec::new(),
            };
            lanes.push(Lane {
                side,
                topic,
                pipes,
                wall: Duration::ZERO,
                bench_cpu: 0.0,
                server: ServerTime::default(),
            });
        }
        let batches_per_slice = (SLICE as usize).div_ceil(PUT_BATCH);
        let mut from = 0u64;
        let mut slice = 0usize;
        while from < jobs {
            let to = (from + SLICE).min(jobs);
            let first = (slice + round) % lanes.len();
            for k in 0..lanes.len() {
                let count = lanes.len();
                let lane = &mut lanes[(first + k) % count];
                let before = ServerMark::now(&bench.conn, server_pid).await?;
                let cpu_before = cpu_seconds(me).unwrap_or(0.0);
                let started = Instant::now();
                match lane.side {
                    Side::Store => {
                        bench
                            .put_range(&lane.topic, "job", from, to, |n| Due::Delay(delay_of(n)))
                            .await?;
                    }
                    side => {
                        let b = slice * batches_per_slice;
                        let e = (b + batches_per_slice).min(lane.pipes.len());
                        run_pipes(bench, side, &lane.pipes[b..e]).await?;
                    }
                }
                lane.wall += started.elapsed();
                lane.bench_cpu += cpu_seconds(me).unwrap_or(0.0) - cpu_before;
                let after = ServerMark::now(&bench.conn, server_pid).await?;
                before.add_since(&after, &mut lane.server);
            }
            from = to;
            slice += 1;
        }
        let mut result = json!({ "round": round + 1 });
        for lane in &lanes {
            let stored = bench.store.stats(&lane.topic).await?;
            let keys = bench.store.keys().all(&lane.topic);
            // The bare script writes only `scheduled` and `jobs`; the others must hold
            // every job too.
            let scheduled: u64 = redis::cmd("ZCARD")
                .arg(&keys[0])
                .query_async(&mut bench.conn.clone())
                .await?;
            if scheduled != jobs || (lane.side != Side::Bare && stored.scheduled != jobs) {
                bail!(
                    "{}: {scheduled} jobs in scheduled after {jobs} puts",
                    lane.side.name()
                );
            }
            let per_call = |us: f64| us / jobs as f64;
            result[lane.side.name()] = json!({
                "calls_per_s": (jobs as f64 / lane.wall.as_secs_f64().max(1e-9)).round(),
                "bench_cpu_us_per_call": per_call(lane.bench_cpu * 1e6),
                "server_cpu_us_per_call": lane.server.cpu_us.map(per_call),
                "evalsha_us_per_call": lane.server.evalsha_us_per_call(),
            });
            let mut unlink = redis::cmd("UNLINK");
            unlink.arg(&keys[..]);
            let _: u64 = unlink.query_async(&mut bench.conn.clone()).await?;
        }
        eprintln!(
            "  round {}: calls/s bare {} put.lua {} store {}",
            round + 1,
            result["bare"]["calls_per_s"],
            result["put_lua"]["calls_per_s"],
            result["store"]["calls_per_s"]
        );
        results.push(result);
    }
    let load_after = load_average();
    Ok(summarize(
        results,
        &sides,
        jobs,
        server_pid.is_some(),
        (load_before, load_after),
    ))
}

fn summarize(
    rounds: Vec<Value>,
    sides_run: &[Side],
    jobs: u64,
    private: bool,
    (load_before, load_after): (Value, Value),
) -> Value {
    let spread = |values: Vec<f64>, decimals: i32| {
        Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals))
    };
    let field = |side: &str, name: &str| -> Vec<f64> {
        rounds
            .iter()
            .filter_map(|r| r[side][name].as_f64())
            .collect()
    };
    // Paired within each round: a throughput ratio, or a cost ratio (bare / side).
    let paired = |side: &str, name: &str, cost: bool| -> Vec<f64> {
        rounds
            .iter()
            .filter_map(|r| {
                let (s, b) = (r[side][name].as_f64()?, r["bare"][name].as_f64()?);
                Some(if cost { b / s } else { s / b })
            })
            .collect()
    };
    let mut sides = json!({});
    for &side in sides_run {
        let n = side.name();
        sides[n] = json!({
            "calls_per_s": spread(field(n, "calls_per_s"), 0),
            "bench_cpu_us_per_call": spread(field(n, "bench_cpu_us_per_call"), 2),
            "server_cpu_us_per_call": spread(field(n, "server_cpu_us_per_call"), 2),
            "evalsha_us_per_call": spread(field(n, "evalsha_us_per_call"), 2),
        });
    }
    json!({
        "jobs_per_side": jobs,
        "slice_jobs": SLICE,
        "runs": rounds.len(),
        "private_redis": private,
        "bare_script": BARE_SCRIPT,
        "order": "the sides take turns every slice_jobs; the first side rotates by slice and by round",
        "sides": sides,
        "ratios_vs_bare": {
            "put_lua_rate": spread(paired("put_lua", "calls_per_s", false), 3),
            "store_rate": spread(paired("store", "calls_per_s", false), 3),
            "put_lua_server_cpu": spread(paired("put_lua", "server_cpu_us_per_call", true), 3),
            "put_lua_evalsha_time": spread(paired("put_lua", "evalsha_us_per_call", true), 3),
            "store_server_cpu": spread(paired("store", "server_cpu_us_per_call", true), 3),
            "put_lua_other_rate": spread(paired("put_lua_other", "calls_per_s", false), 3),
            "put_lua_other_server_cpu": spread(paired("put_lua_other", "server_cpu_us_per_call", true), 3),
            "put_lua_other_evalsha_time": spread(paired("put_lua_other", "evalsha_us_per_call", true), 3),
        },
        "load_average": { "before": load_before, "after": load_after },
        "rounds": rounds,
    })
}

pub(crate) fn print_table(c: &Value) {
    if !c.is_object() {
        return;
    }
    let s = &c["sides"];
    let r = &c["ratios_vs_bare"];
    println!();
    println!(
        "put cost: {} rounds, {} jobs per side and round, sides alternating every {} jobs; {}; load average before {} after {}",
        c["runs"],
        c["jobs_per_side"],
        c["slice_jobs"],
        if c["private_redis"].as_bool() == Some(true) {
            "private Redis (server figures are this run's alone)"
        } else {
            "shared Redis (no server figures)"
        },
        c["load_average"]["before"],
        c["load_average"]["after"]
    );
    let other = s["put_lua_other"].is_object();
    let extra = |v: String| {
        if other {
            format!(" {v} |")
        } else {
            String::new()
        }
    };
    println!(
        "median (min–max) | bare ZADD+HSET script | put.lua | Store::apply |{}",
        extra("other put.lua".into())
    );
    println!("|---|---:|---:|---:|{}", extra("---:".into()));
    for (label, name, decimals) in [
        ("calls/s, pipelined", "calls_per_s", 0),
        ("bench CPU µs/call", "bench_cpu_us_per_call", 2),
        ("Redis CPU µs/call", "server_cpu_us_per_call", 2),
        ("EVALSHA µs/call (commandstats)", "evalsha_us_per_call", 2),
    ] {
        println!(
            "| {label} | {} | {} | {} |{}",
            spread_text(&s["bare"][name], decimals),
            spread_text(&s["put_lua"][name], decimals),
            spread_text(&s["store"][name], decimals),
            extra(spread_text(&s["put_lua_other"][name], decimals))
        );
    }
    println!(
        "| ratio to bare, rate (paired per round) | 1 | {} | {} |{}",
        spread_text(&r["put_lua_rate"], 3),
        spread_text(&r["store_rate"], 3),
        extra(spread_text(&r["put_lua_other_rate"], 3))
    );
    println!(
        "| ratio to bare, Redis CPU (bare/side) | 1 | {} | {} |{}",
        spread_text(&r["put_lua_server_cpu"], 3),
        spread_text(&r["store_server_cpu"], 3),
        extra(spread_text(&r["put_lua_other_server_cpu"], 3))
    );
    println!(
        "| ratio to bare, EVALSHA time (bare/side) | 1 | {} | - |{}",
        spread_text(&r["put_lua_evalsha_time"], 3),
        extra(spread_text(&r["put_lua_other_evalsha_time"], 3))
    );
}

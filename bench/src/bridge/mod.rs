//! The bridge scenarios of `redisched-bench` (issue 5): dispatch, ingest, precision,
//! cancel, the bridge's RSS, the BullMQ peer, and `all`, which also runs `store` and
//! writes one table, one JSON file and one SVG chart.
//!
//! ```text
//! cargo build --release -p redisched-bench -p redisched
//! target/release/redisched-bench all            # the full run (about 10 minutes)
//! target/release/redisched-bench all --quick    # CI: under about a minute
//! target/release/redisched-bench dispatch --jobs 50000
//! target/release/redisched-bench dispatch --jobs 30000 --runs 9   # history on vs off, 9 rounds
//! ```
//!
//! The bridge runs as a child `redisched run` (the binary beside this one) configured by
//! `REDISCHED_*` env vars; every scenario uses its own exchange/queue names and key
//! prefix (`bench-<scenario>-<pid>-…`) and deletes them at the end, also on failure.

mod cancel;
mod catchup;
mod chart;
pub(crate) mod common;
mod dispatch;
mod ingest;
mod peer;
mod precision;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

pub use common::Env;

#[derive(Subcommand)]
pub enum BridgeCommand {
    /// Dispatch throughput (N due jobs -> published, confirmed, released) beside a plain
    /// confirmed lapin publisher; also the bridge's RSS.
    Dispatch(Box<RunArgs>),
    /// Ingest throughput (N waiting put commands -> applied, acked) beside a plain
    /// consume-and-ack lapin consumer.
    Ingest(Box<RunArgs>),
    /// Lateness at steady rates with random delays, end to end, and early deliveries.
    Precision(Box<RunArgs>),
    /// Deletes by id per second through the Lua script and through AMQP.
    Cancel(Box<RunArgs>),
    /// Catch-up after an outage: N jobs due at once, drained beside the dispatch ceiling,
    /// while an on-time topic (150 jobs/s, delays 0-2 s) keeps its lateness (fairness).
    Catchup(Box<RunArgs>),
    /// BullMQ on the same Redis (needs `npm ci --prefix bench/peer`).
    Peer(Box<RunArgs>),
    /// Everything (store included): one table, `artifacts/bench.json`, `artifacts/bench.svg`.
    All(Box<RunArgs>),
}

#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// Small sizes and short phases, for CI (about a minute for `all`).
    #[arg(long)]
    pub quick: bool,
    /// Jobs for the dispatch scenario [default: 200000; quick 10000].
    #[arg(long)]
    pub jobs: Option<u64>,
    /// Commands for the ingest scenario [default: 200000; quick 10000].
    #[arg(long)]
    pub commands: Option<u64>,
    /// Deletes through the Lua script [default: 200000; quick 20000].
    #[arg(long)]
    pub deletes: Option<u64>,
    /// Deletes through AMQP [default: 100000; quick 5000].
    #[arg(long)]
    pub amqp_deletes: Option<u64>,
    /// Precision rates, jobs/s [default: 100,1000,5000; quick 100,1000].
    #[arg(long, value_delimiter = ',')]
    pub rates: Option<Vec<u64>>,
    /// Seconds of steady load per rate [default: 20; quick 3].
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Random delays are 0..=this many ms [default: 10000; quick 2000].
    #[arg(long)]
    pub max_delay_ms: Option<u64>,
    /// Jobs all due at once in the catchup scenario (about 430 MB of Redis per 1,000,000
    /// at 200-byte bodies; checked before loading) [default: 1000000; quick 20000].
    #[arg(long)]
    pub catchup_jobs: Option<u64>,
    /// Topics the catchup backlog is spread over, evenly.
    #[arg(long, default_value_t = 1)]
    pub catchup_topics: usize,
    /// Confirm window of the bridge and of the ceiling publishers (dispatch, catchup).
    #[arg(long, default_value_t = 1000)]
    pub window: usize,
    /// Bridge processes dispatching together (dispatch); CPU and RSS are the first's.
    #[arg(long, default_value_t = 1)]
    pub bridges: usize,
    /// Outcome history of the dispatching bridge (issue 10, `history.max_per_topic`):
    /// `both` alternates the default cap (1000) and 0 in one run, `--runs` rounds.
    #[arg(long, value_enum, default_value_t = common::HistoryChoice::Both)]
    pub history: common::HistoryChoice,
    /// Bridge passes per history side in the dispatch scenario (medians need >= 3).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Body size of dispatched, ingested and caught-up jobs.
    #[arg(long, default_value_t = 200)]
    pub body_bytes: usize,
    /// Delayed jobs BullMQ adds and removes for its add/remove/memory figures
    /// [default: 100000; quick 5000].
    #[arg(long)]
    pub peer_jobs: Option<u64>,
    /// BullMQ lateness rates [default: 1000,5000; quick 1000].
    #[arg(long, value_delimiter = ',')]
    pub peer_rates: Option<Vec<u64>>,
    /// `all` only: skip the BullMQ peer.
    #[arg(long)]
    pub no_peer: bool,
    /// `all` only: skip the store bench.
    #[arg(long)]
    pub no_store: bool,
    /// JSON report [default: artifacts/bench.json for `all`, artifacts/bench-<scenario>.json].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// SVG chart [default: the JSON path with .svg].
    #[arg(long)]
    pub svg: Option<PathBuf>,
    #[arg(
        long,
        env = "REDISCHED_REDIS__URL",
        default_value = "redis://127.0.0.1:6379/0"
    )]
    pub redis_url: String,
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

impl RunArgs {
    fn pick<T: Clone>(&self, value: &Option<T>, full: T, quick: T) -> T {
        value
            .clone()
            .unwrap_or(if self.quick { quick } else { full })
    }
    fn dispatch(&self) -> dispatch::Params {
        dispatch::Params {
            jobs: self.pick(&self.jobs, 200_000, 10_000),
            body_bytes: self.body_bytes,
            window: self.window,
            bridges: self.bridges.max(1),
            history: self.history,
            runs: self.runs.max(1),
        }
    }
    fn ingest(&self) -> ingest::Params {
        ingest::Params {
            commands: self.pick(&self.commands, 200_000, 10_000),
            body_bytes: self.body_bytes,
        }
    }
    fn precision(&self) -> precision::Params {
        precision::Params {
            rates: self.pick(&self.rates, vec![100, 1000, 5000], vec![100, 1000]),
            seconds: self.pick(&self.seconds, 20.0, 3.0),
            max_delay_ms: self.pick(&self.max_delay_ms, 10_000, 2_000),
            body_bytes: self.body_bytes,
        }
    }
    fn cancel(&self) -> cancel::Params {
        cancel::Params {
            deletes: self.pick(&self.deletes, 200_000, 20_000),
            amqp_deletes: self.pick(&self.amqp_deletes, 100_000, 5_000),
            body_bytes: self.body_bytes,
        }
    }
    fn catchup(&self) -> catchup::Params {
        catchup::Params {
            jobs: self.pick(&self.catchup_jobs, 1_000_000, 20_000),
            topics: self.catchup_topics.max(1),
            body_bytes: self.body_bytes,
            window: self.window,
        }
    }
    fn peer(&self) -> peer::Params {
        peer::Params {
            jobs: self.pick(&self.peer_jobs, 100_000, 5_000),
            rates: self.pick(&self.peer_rates, vec![1000, 5000], vec![1000]),
            seconds: self.pick(&self.seconds, 20.0, 3.0),
            max_delay_ms: self.pick(&self.max_delay_ms, 10_000, 2_000),
            // As the store's memory figure: 100-byte bodies, 20-byte ids.
            body_bytes: 100,
            redis_url: self.redis_url.clone(),
        }
    }
    fn env(&self) -> Result<Env> {
        Env::new(
            self.redis_url.clone(),
            self.amqp_url.clone(),
            self.bridge_bin.clone(),
        )
    }
}

/// Runs one bridge scenario, or all of them. `store` runs the store bench (defined by
/// the main file) writing its JSON to the given path, for `all`.
pub async fn run<F, Fut>(command: BridgeCommand, store: F) -> Result<()>
where
    F: FnOnce(bool, PathBuf) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let started = Instant::now();
    let (name, args) = match &command {
        BridgeCommand::Dispatch(a) => ("dispatch", a),
        BridgeCommand::Ingest(a) => ("ingest", a),
        BridgeCommand::Precision(a) => ("precision", a),
        BridgeCommand::Cancel(a) => ("cancel", a),
        BridgeCommand::Catchup(a) => ("catchup", a),
        BridgeCommand::Peer(a) => ("peer", a),
        BridgeCommand::All(a) => ("all", a),
    };
    let out = args.out.clone().unwrap_or_else(|| {
        if name == "all" {
            PathBuf::from("artifacts/bench.json")
        } else {
            PathBuf::from(format!("artifacts/bench-{name}.json"))
        }
    });
    let svg = args
        .svg
        .clone()
        .unwrap_or_else(|| out.with_extension("svg"));
    let mut report = json!({
        "date": now_utc(),
        "machine": machine(),
        "quick": args.quick,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    match &command {
        BridgeCommand::Dispatch(a) => {
            report["dispatch"] = dispatch::run(&a.env()?, &a.dispatch()).await?
        }
        BridgeCommand::Ingest(a) => {
            report["ingest"] = ingest::run(&a.env()?, ingest::Kind::Put, &a.ingest()).await?
        }
        BridgeCommand::Precision(a) => {
            report["precision"] = precision::run(&a.env()?, &a.precision()).await?
        }
        BridgeCommand::Cancel(a) => report["cancel"] = cancel::run(&a.env()?, &a.cancel()).await?,
        BridgeCommand::Catchup(a) => {
            report["catchup"] = catchup::run(&a.env()?, &a.catchup()).await?
        }
        BridgeCommand::Peer(a) => report["peer"] = peer::run(&a.peer()).await?,
        BridgeCommand::All(a) => {
            let env = a.env()?;
            if !a.no_store {
                let store_out = out.with_file_name("bench-store.json");
                eprintln!(
                    "store: running `redisched-bench store{}`",
                    if a.quick { " --quick" } else { "" }
                );
                store(a.quick, store_out.clone())
                    .await
                    .context("store bench")?;
                report["store"] = read_json(&store_out)?;
            }
            report["dispatch"] = dispatch::run(&env, &a.dispatch()).await?;
            report["ingest"] = ingest::run(&env, ingest::Kind::Put, &a.ingest()).await?;
            report["precision"] = precision::run(&env, &a.precision()).await?;
            report["cancel"] = cancel::run(&env, &a.cancel()).await?;
            report["catchup"] = catchup::run(&env, &a.catchup()).await?;
            if !a.no_peer {
                match peer::run(&a.peer()).await {
                    Ok(peer) => report["peer"] = peer,
                    // The peer needs Node and `npm ci`; its absence must not fail CI.
                    Err(err) => {
                        eprintln!("peer skipped: {err:#}");
                        report["peer"] = json!({ "skipped": format!("{err:#}") });
                    }
                }
            }
        }
    }
    report["total_seconds"] = json!(common::round2(started.elapsed().as_secs_f64()));
    print_table(&report);
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", out.display()))?;
    chart::draw(&report, &svg)?;
    println!(
        "\nwrote {} and {} ({:.1} s)",
        out.display(),
        svg.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))
}

fn now_utc() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn machine() -> Value {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    json!({ "cpus": cpus, "cpu_model": model, "note": "shared machine: Redis, RabbitMQ, the bridge and the bench on the same cores" })
}

fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x >= 1_000.0 => {
            let s = format!("{:.0}", x);
            let mut out = String::new();
            for (i, c) in s.chars().enumerate() {
                if i > 0 && (s.len() - i).is_multiple_of(3) {
                    out.push(',');
                }
                out.push(c);
            }
            out
        }
        Some(x) if x.fract() == 0.0 || x >= 100.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.2}"),
        None => "-".into(),
    }
}

fn pct(v: &Value) -> String {
    v.as_f64()
        .map(|x| format!("{:.0}%", x * 100.0))
        .unwrap_or_else(|| "-".into())
}

fn print_table(r: &Value) {
    let mut rows: Vec<[String; 5]> = Vec::new();
    let d = &r["dispatch"];
    if d.is_object() {
        rows.push([
            format!(
                "dispatch, {} due jobs of {} B (jobs/s)",
                num(&d["jobs"]),
                d["body_bytes"]
            ),
            num(&d["bridge"]["jobs_per_s"]),
            format!(
                "{} (lapin confirmed publish, window {})",
                num(&d["ceiling"]["msgs_per_s"]),
                d["window"]
            ),
            pct(&d["ratio"]),
            ">= 80%".into(),
        ]);
        rows.push([
            "bridge RSS while dispatching (peak / idle after)".into(),
            format!(
                "{} / {} MiB",
                kib_to_mib(&d["bridge_rss_kib"]["peak_while_dispatching"]),
                kib_to_mib(&d["bridge_rss_kib"]["idle_after"])
            ),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
        let h = &d["history"];
        for side in ["on", "off"] {
            let s = &h["sides"][side];
            if s.is_object() {
                rows.push([
                    format!(
                        "dispatch, history {side} (history.max_per_topic = {}), median (min–max) of {} passes (jobs/s)",
                        s["history_max"], s["jobs_per_s"]["runs"]
                    ),
                    common::spread_text(&s["jobs_per_s"], 0),
                    format!("{} (mean of before and after)", num(&d["ceiling"]["msgs_per_s"])),
                    common::spread_text(&s["vs_ceiling"], 2),
                    "-".into(),
                ]);
            }
        }
        if h["ratio_on_off"]["jobs_per_s"].is_object() {
            rows.push([
                format!(
                    "dispatch ratio history on / off, paired per round (load average before {}, after {})",
                    h["load_average"]["before"], h["load_average"]["after"]
                ),
                common::spread_text(&h["ratio_on_off"]["jobs_per_s"], 3),
                format!(
                    "after the first delivery: {}",
                    common::spread_text(&h["ratio_on_off"]["jobs_per_s_after_first_delivery"], 3)
                ),
                "-".into(),
                ">= 0.90 (issue 10)".into(),
            ]);
        }
    }
    let i = &r["ingest"];
    if i.is_object() {
        rows.push([
            format!("ingest, {} waiting puts (commands/s)", num(&i["commands"])),
            num(&i["bridge"]["commands_per_s"]),
            format!(
                "{} (consume + ack each, prefetch {}); {} with multiple-ack/100",
                num(&i["ceiling"]["one_ack_per_message_per_s"]),
                i["prefetch"],
                num(&i["ceiling"]["multiple_ack_per_100_per_s"])
            ),
            format!(
                "{} ({} of multiple-ack)",
                pct(&i["ratio"]),
                pct(&i["ratio_to_multiple_ack"])
            ),
            ">= 80%".into(),
        ]);
    }
    for rate in r["precision"]["rates"].as_array().into_iter().flatten() {
        let l = &rate["lateness_ms"];
        rows.push([
            format!(
                "lateness at {}/s (ms: p50 / p99 / p99.9 / max; early)",
                rate["rate_per_s"]
            ),
            format!(
                "{} / {} / {} / {}; {} early",
                num(&l["p50_ms"]),
                num(&l["p99_ms"]),
                num(&l["p999_ms"]),
                num(&l["max_ms"]),
                l["early"]
            ),
            {
                let f = &rate["floor_lateness_ms"];
                format!(
                    "{} / {} / {} / {} (timer -> publish -> consume floor)",
                    num(&f["p50_ms"]),
                    num(&f["p99_ms"]),
                    num(&f["p999_ms"]),
                    num(&f["max_ms"])
                )
            },
            "-".into(),
            match rate["target_p99_ms"].as_f64() {
                Some(t) => format!("p99 <= {t} ms, 0 early"),
                None => "0 early".into(),
            },
        ]);
    }
    let c = &r["cancel"];
    if c.is_object() {
        rows.push([
            "cancel via delete.lua, Store::apply batches (deletes/s)".into(),
            num(&c["lua"]["deletes_per_s"]),
            format!(
                "{} (raw ZREM+HDEL pipelined)",
                num(&c["lua"]["ceiling"]["deletes_per_s"])
            ),
            pct(&c["lua"]["ratio"]),
            "-".into(),
        ]);
        rows.push([
            "cancel via AMQP delete commands (deletes/s)".into(),
            num(&c["amqp"]["bridge"]["commands_per_s"]),
            format!(
                "{} (consume + ack each)",
                num(&c["amqp"]["ceiling"]["one_ack_per_message_per_s"])
            ),
            pct(&c["amqp"]["ratio"]),
            "-".into(),
        ]);
    }
    if !rows.is_empty() {
        println!("\n| scenario | redisched | ceiling (same run) | ratio | target |");
        println!("|---|---|---|---|---|");
        for row in &rows {
            println!("| {} |", row.join(" | "));
        }
    }
    let p = &r["peer"];
    if p["add_remove_memory"].is_object() {
        let m = &p["add_remove_memory"];
        println!(
            "\n| peer, same Redis | redisched | BullMQ {} |",
            p["version"].as_str().unwrap_or("")
        );
        println!("|---|---|---|");
        println!(
            "| add (jobs/s) | {} via AMQP commands | {} (addBulk of 1,000) |",
            num(&i["bridge"]["commands_per_s"]),
            num(&m["add_per_s"])
        );
        println!(
            "| remove by id (jobs/s) | {} via delete.lua, {} via AMQP | {} (queue.remove) |",
            num(&c["lua"]["deletes_per_s"]),
            num(&c["amqp"]["bridge"]["commands_per_s"]),
            num(&m["remove_per_s"])
        );
        for rate in p["rates"].as_array().into_iter().flatten() {
            let ours = r["precision"]["rates"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|x| x["rate_per_s"] == rate["rate_per_s"]);
            let fmt = |l: &Value| {
                format!(
                    "{} / {} / {}",
                    num(&l["p50_ms"]),
                    num(&l["p99_ms"]),
                    num(&l["max_ms"])
                )
            };
            println!(
                "| lateness at {}/s (ms: p50 / p99 / max) | {} | {} |",
                rate["rate_per_s"],
                ours.map(|o| fmt(&o["lateness_ms"]))
                    .unwrap_or_else(|| "-".into()),
                fmt(&rate["lateness_ms"])
            );
        }
        println!(
            "| Redis bytes per delayed job ({} B body, {} B id) | {} | {} (INFO delta), {} (MEMORY USAGE) |",
            m["body_bytes"],
            m["id_bytes"],
            r["store"]["memory"]
                .as_array()
                .and_then(|a| a.last())
                .map(|x| format!("{} (INFO delta at {} jobs)", num(&x["bytes_per_job"]), num(&x["jobs"])))
                .unwrap_or_else(|| "see the store bench".into()),
            num(&m["redis_bytes_per_job_info_delta"]),
            num(&m["redis_bytes_per_job_memory_usage"])
        );
    }
}

fn kib_to_mib(v: &Value) -> String {
    v.as_f64()
        .map(|k| format!("{:.1}", k / 1024.0))
        .unwrap_or_else(|| "-".into())
}

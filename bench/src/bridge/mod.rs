//! The bridge scenarios of `redisched-bench`: dispatch, ingest,
//! precision, cancel, catch-up, the bridge's RSS, webhook targets, the BullMQ peer, and `all`, which also
//! runs `store` and writes one table, one JSON file and one SVG chart.
//!
//! ```text
//! cargo build --release -p redisched-bench -p redisched
//! target/release/redisched-bench all --runs 3       # the full run, 3 interleaved rounds
//! target/release/redisched-bench all --quick        # CI: about a minute
//! target/release/redisched-bench precision --rates 1000,5000
//! target/release/redisched-bench catchup --catchup-jobs 100000
//! target/release/redisched-bench dispatch --jobs 50000
//! target/release/redisched-bench webhook            # 100,000 POSTs, 1,000/s, 10,000 held; 3 rounds
//! target/release/redisched-bench dispatch --jobs 30000 --runs 9   # history on vs off, 9 rounds
//! target/release/redisched-bench report             # the performance page's table (page.rs)
//! target/release/redisched-bench compare --baseline-bin <old redisched> dispatch --runs 3
//! ```
//!
//! `all --runs N` runs every scenario once per round, N rounds (so a drift of the shared
//! machine hits every scenario alike), and prints every figure as median (min–max) of the
//! rounds; `artifacts/bench.json` keeps each round's raw figures under `rounds`, the
//! medians under `summary`, and round 1 at the top level as before `--runs` existed.
//! Without `--quick` it also saves the rounds' figures as the results of record,
//! `bench/results/<UTC start>-<commit>.json` (results.rs), which `report` reads.
//! `compare` runs one scenario with two bridge binaries in interleaved rounds
//! (compare.rs).
//! Every report starts with its context: UTC start and end, git commit, load average at
//! start and end, Redis and RabbitMQ versions.
//!
//! The bridge runs as a child `redisched run` (the binary beside this one) configured by
//! `REDISCHED_*` env vars; every scenario uses its own exchange/queue names and key
//! prefix (`bench-<scenario>-<pid>-…`) and deletes them at the end, also on failure.

mod cancel;
mod catchup;
mod chart;
pub(crate) mod common;
pub(crate) mod compare;
mod dispatch;
mod figures;
mod ingest;
pub(crate) mod page;
mod peer;
mod plain_http;
mod precision;
mod report;
mod results;
mod table;
pub(crate) mod tenm;
pub(crate) mod webhook;
mod webhook_floor;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

pub(crate) use common::Env;

#[derive(Subcommand)]
pub(crate) enum BridgeCommand {
    /// Dispatch throughput (N due jobs -> published, confirmed, released) beside a plain
    /// confirmed lapin publisher and the best of 1, 2, 4, 8 such publishers; also the
    /// bridge's RSS.
    Dispatch(Box<RunArgs>),
    /// Ingest throughput (N waiting put commands -> applied, acked) beside a plain
    /// consume-and-ack lapin consumer.
    Ingest(Box<RunArgs>),
    /// Lateness at steady rates with random delays, end to end, vs x-redisched-due-at and
    /// vs the producer's clock (publish + x-delay), beside the same schedule's floor
    /// through two broker hops without Redis; and early deliveries.
    Precision(Box<RunArgs>),
    /// Deletes by id per second through the Lua script and through AMQP.
    Cancel(Box<RunArgs>),
    /// Catch-up after an outage: N jobs due at once, drained beside the dispatch ceiling,
    /// while an on-time topic (150 jobs/s, delays 0-2 s) keeps its lateness (fairness).
    Catchup(Box<RunArgs>),
    /// BullMQ on the same Redis (needs `npm ci --prefix bench/peer`).
    Peer(Box<RunArgs>),
    /// Webhook targets, each figure beside its same-run ceiling or floor: N due jobs
    /// POSTed to a local receiver vs a plain reqwest client of the same concurrency, and
    /// the bookkeeping floor (that client plus only the bare Redis commands per job);
    /// lateness at a steady rate vs one AMQP hop + one POST; the bridge's RSS with many
    /// requests held open by a slow receiver. `--runs` rounds [default: 3].
    Webhook(Box<RunArgs>),
    /// Everything (store included), `--runs` rounds: one table (median (min–max) of the
    /// rounds), `artifacts/bench.json`, `artifacts/bench.svg`.
    All(Box<RunArgs>),
}

#[derive(Args, Clone, Debug)]
pub(crate) struct RunArgs {
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
    /// Seconds of steady load measured per rate, after the warm-up [default: 30; quick 3].
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Random delays are 0..=this many ms [default: 10000; quick 2000].
    #[arg(long)]
    pub max_delay_ms: Option<u64>,
    /// Precision and peer: load before the measured `--seconds`, so that jobs go out at
    /// the full rate while commands come in at it (steady state); jobs due in it are
    /// delivered and checked but not counted [default: the longest delay].
    #[arg(long)]
    pub warm_up_ms: Option<u64>,
    /// Precision: commands name their due time as `x-deliver-at` (the producer's publish
    /// instant + the delay) instead of `x-delay`, so the time a command takes to be
    /// applied no longer moves its due time.
    #[arg(long)]
    pub deliver_at: bool,
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
    /// Confirm channels of the dispatching bridge (`dispatch.channels`; dispatch).
    #[arg(long, default_value_t = 1)]
    pub channels: usize,
    /// Bridge processes dispatching (dispatch) or ingesting (ingest) together; CPU and
    /// RSS are the first's.
    #[arg(long, default_value_t = 1)]
    pub bridges: usize,
    /// `amqp.command_partitions` of the ingesting bridges (ingest): commands wait in the
    /// route queue and each bridge's router and lanes apply them.
    #[arg(long, default_value_t = 1)]
    pub partitions: u16,
    /// Outcome history of the dispatching bridge (`history.max_per_topic`):
    /// `both` alternates the default cap (1000) and 0 in one run, `--runs` rounds.
    #[arg(long, value_enum, default_value_t = common::HistoryChoice::Both)]
    pub history: common::HistoryChoice,
    /// `dispatch`: bridge passes per history side [default: 3; medians need >= 3].
    /// `all`: rounds of every scenario, interleaved, printed as median (min–max) of the
    /// rounds [default: 1]; each round's dispatch makes one pass per history side, so
    /// the on/off pairs are the rounds.
    #[arg(long)]
    pub runs: Option<usize>,
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
    /// Webhook: due jobs POSTed for the throughput figure [default: 100000; quick 5000].
    #[arg(long)]
    pub webhook_jobs: Option<u64>,
    /// Webhook: the target's `max_in_flight`, and the ceiling's and floor's concurrency.
    #[arg(long, default_value_t = 64)]
    pub webhook_in_flight: usize,
    /// Webhook: put commands per second of the lateness figure.
    #[arg(long, default_value_t = 1000)]
    pub webhook_rate: u64,
    /// Webhook: seconds of steady state measured [default: 30; quick 3].
    #[arg(long)]
    pub webhook_seconds: Option<f64>,
    /// Webhook: random delays 0..=this many ms, and the warm-up before measuring
    /// [default: 5000; quick 1000].
    #[arg(long)]
    pub webhook_max_delay_ms: Option<u64>,
    /// Webhook: requests held open by the slow receiver of the memory figure (also
    /// that target's `max_in_flight`) [default: 10000; quick 1000].
    #[arg(long)]
    pub webhook_held: Option<u64>,
    /// Webhook: how long the slow receiver holds each request [default: 30000; quick 2000].
    #[arg(long)]
    pub webhook_hold_ms: Option<u64>,
    /// `all` only: skip the BullMQ peer.
    #[arg(long)]
    pub no_peer: bool,
    /// `all` only: skip the store bench.
    #[arg(long)]
    pub no_store: bool,
    /// `all`: where the run's results file goes (`<UTC start>-<commit>.json`: every
    /// round's figures without time series, read by `report`) [default: bench/results;
    /// not saved for `--quick` unless this is given].
    #[arg(long)]
    pub results_dir: Option<PathBuf>,
    /// `all`: save no results file.
    #[arg(long)]
    pub no_results: bool,
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
    /// A configuration key of every bridge the scenarios start, as `section.key=value`
    /// (`ingest.prefetch=2000`; the value as JSON, else as text); repeatable. Set after
    /// the scenario's own settings, so it wins over them.
    #[arg(long = "bridge-set", value_name = "KEY=VALUE")]
    pub bridge_set: Vec<String>,
}

/// Bridge passes per history side of `dispatch` when `--runs` is not given.
const DISPATCH_PASSES: usize = 3;
/// Rounds of `webhook` when `--runs` is not given (`all` makes one per round).
const WEBHOOK_RUNS: usize = 3;

impl RunArgs {
    fn pick<T: Clone>(&self, value: &Option<T>, full: T, quick: T) -> T {
        value
            .clone()
            .unwrap_or(if self.quick { quick } else { full })
    }
    /// `passes` bridge passes per history side.
    fn dispatch(&self, passes: usize) -> dispatch::Params {
        dispatch::Params {
            jobs: self.pick(&self.jobs, 200_000, 10_000),
            body_bytes: self.body_bytes,
            window: self.window,
            channels: self.channels.max(1),
            bridges: self.bridges.max(1),
            history: self.history,
            runs: passes.max(1),
        }
    }
    fn ingest(&self) -> ingest::Params {
        ingest::Params {
            commands: self.pick(&self.commands, 200_000, 10_000),
            body_bytes: self.body_bytes,
            partitions: self.partitions.max(1),
            bridges: self.bridges.max(1),
        }
    }
    fn precision(&self) -> precision::Params {
        precision::Params {
            rates: self.pick(&self.rates, vec![100, 1000, 5000], vec![100, 1000]),
            seconds: self.pick(&self.seconds, 30.0, 3.0),
            max_delay_ms: self.max_delay(),
            warm_up_ms: self.warm_up_ms.unwrap_or(self.max_delay()),
            body_bytes: self.body_bytes,
            deliver_at: self.deliver_at,
        }
    }
    fn max_delay(&self) -> u64 {
        self.pick(&self.max_delay_ms, 10_000, 2_000)
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
            seconds: self.pick(&self.seconds, 30.0, 3.0),
            max_delay_ms: self.max_delay(),
            warm_up_ms: self.warm_up_ms.unwrap_or(self.max_delay()),
            // As the store's memory figure: 100-byte bodies, 20-byte ids.
            body_bytes: 100,
            redis_url: self.redis_url.clone(),
        }
    }
    fn webhook(&self, runs: usize) -> webhook::Params {
        webhook::Params {
            jobs: self.pick(&self.webhook_jobs, 100_000, 5_000),
            max_in_flight: self.webhook_in_flight.max(1),
            body_bytes: self.body_bytes,
            runs: runs.max(1),
            rate: self.webhook_rate.max(1),
            seconds: self.pick(&self.webhook_seconds, 30.0, 3.0),
            max_delay_ms: self.pick(&self.webhook_max_delay_ms, 5_000, 1_000),
            held: self.pick(&self.webhook_held, 10_000, 1_000),
            hold_ms: self.pick(&self.webhook_hold_ms, 30_000, 2_000),
        }
    }
    /// Where `name`'s results file goes, if anywhere: only `all` saves one.
    fn results_dir_of(&self, name: &str) -> Option<PathBuf> {
        if name != "all" || self.no_results || (self.quick && self.results_dir.is_none()) {
            return None;
        }
        Some(
            self.results_dir
                .clone()
                .unwrap_or_else(results::default_dir),
        )
    }
    fn env(&self) -> Result<Env> {
        Env::new(
            self.redis_url.clone(),
            self.amqp_url.clone(),
            self.bridge_bin.clone(),
            &self.bridge_set,
        )
    }
}

/// Runs one bridge scenario, or all of them. `store` runs the store bench (defined by
/// the main file) writing its JSON to the given path, once per round of `all`.
pub(crate) async fn run<F, Fut>(command: BridgeCommand, store: F) -> Result<()>
where
    F: Fn(bool, PathBuf) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let started = Instant::now();
    let (name, args) = match &command {
        BridgeCommand::Dispatch(a) => ("dispatch", a),
        BridgeCommand::Ingest(a) => ("ingest", a),
        BridgeCommand::Precision(a) => ("precision", a),
        BridgeCommand::Cancel(a) => ("cancel", a),
        BridgeCommand::Catchup(a) => ("catchup", a),
        BridgeCommand::Peer(a) => ("peer", a),
        BridgeCommand::Webhook(a) => ("webhook", a),
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
    let context = report::RunContext::start(&args.redis_url, &args.amqp_url).await;
    let mut report = json!({
        "date": now_utc(),
        "machine": machine(),
        "quick": args.quick,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    match &command {
        BridgeCommand::Dispatch(a) => {
            report["dispatch"] =
                dispatch::run(&a.env()?, &a.dispatch(a.runs.unwrap_or(DISPATCH_PASSES))).await?
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
        BridgeCommand::Webhook(a) => {
            report["webhook"] =
                webhook::run(&a.env()?, &a.webhook(a.runs.unwrap_or(WEBHOOK_RUNS))).await?
        }
        BridgeCommand::All(a) => {
            let rounds = a.runs.unwrap_or(1).max(1);
            let mut raw = Vec::with_capacity(rounds);
            for round in 1..=rounds {
                eprintln!("== round {round}/{rounds}");
                raw.push(all_round(a, &out, &store, round).await?);
            }
            // Round 1 at the top level, where a single run's figures always were.
            if let (Some(top), Some(first)) = (report.as_object_mut(), raw[0].as_object()) {
                for (key, value) in first {
                    if !["round", "load_average", "seconds", "scenario_seconds"]
                        .contains(&key.as_str())
                    {
                        top.insert(key.clone(), value.clone());
                    }
                }
            }
            report["runs"] = json!(rounds);
            report["summary"] = report::summary(&raw);
            report["rounds"] = json!(raw);
        }
    }
    report["context"] = context.finish();
    report["total_seconds"] = json!(common::round2(started.elapsed().as_secs_f64()));
    table::print_header(&report);
    if report["runs"].as_u64().is_some_and(|r| r > 1) {
        table::print_table(&report["summary"]);
    } else {
        table::print_table(&report);
    }
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", out.display()))?;
    // The chart shows one run's distributions and series: round 1's.
    chart::draw(&report, &svg)?;
    if let Some(dir) = args.results_dir_of(name) {
        let saved = results::save(&results::of_report(&report), &dir)?;
        println!("results of record: {}", saved.display());
    }
    println!(
        "\nwrote {} and {} ({:.1} s)",
        out.display(),
        svg.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The scenarios that run the bridge binary, in the order a round of `all` runs them
/// (`compare` runs one of them with each of two binaries).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Scenario {
    Dispatch,
    Ingest,
    Precision,
    Cancel,
    Catchup,
    Webhook,
}

impl Scenario {
    const ALL: [Scenario; 6] = [
        Scenario::Dispatch,
        Scenario::Ingest,
        Scenario::Precision,
        Scenario::Cancel,
        Scenario::Catchup,
        Scenario::Webhook,
    ];

    /// Its key in a report (and its command's name).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::Dispatch => "dispatch",
            Scenario::Ingest => "ingest",
            Scenario::Precision => "precision",
            Scenario::Cancel => "cancel",
            Scenario::Catchup => "catchup",
            Scenario::Webhook => "webhook",
        }
    }
}

/// One pass of `scenario` with `env`'s bridge binary, as a round of `all` makes it:
/// dispatch one pass per history side, webhook one round.
async fn scenario_round(scenario: Scenario, env: &Env, a: &RunArgs) -> Result<Value> {
    match scenario {
        Scenario::Dispatch => dispatch::run(env, &a.dispatch(1)).await,
        Scenario::Ingest => ingest::run(env, ingest::Kind::Put, &a.ingest()).await,
        Scenario::Precision => precision::run(env, &a.precision()).await,
        Scenario::Cancel => cancel::run(env, &a.cancel()).await,
        Scenario::Catchup => catchup::run(env, &a.catchup()).await,
        Scenario::Webhook => webhook::run(env, &a.webhook(1)).await,
    }
}

/// One round of `all`: every scenario once, in a fixed order; each round's dispatch
/// makes one pass per history side (the rounds pair them).
async fn all_round<F, Fut>(a: &RunArgs, out: &Path, store: &F, round: usize) -> Result<Value>
where
    F: Fn(bool, PathBuf) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let started = Instant::now();
    let load_start = common::load_average();
    let env = a.env()?;
    let mut r = json!({ "round": round });
    // How long each scenario took, so a longer run can be planned from a shorter one.
    let mut took = json!({});
    let mut lap = Instant::now();
    let mut clock = |name: &str| {
        took[name] = json!(common::round2(lap.elapsed().as_secs_f64()));
        lap = Instant::now();
    };
    if !a.no_store {
        let store_out = out.with_file_name("bench-store.json");
        eprintln!(
            "store: running `redisched-bench store{}`",
            if a.quick { " --quick" } else { "" }
        );
        store(a.quick, store_out.clone())
            .await
            .context("store bench")?;
        r["store"] = read_json(&store_out)?;
        clock("store");
    }
    // The ceilings stay per round (dispatch's warm-up pass too).
    for scenario in Scenario::ALL {
        r[scenario.name()] = scenario_round(scenario, &env, a).await?;
        clock(scenario.name());
    }
    if !a.no_peer {
        match peer::run(&a.peer()).await {
            Ok(peer) => r["peer"] = peer,
            // The peer needs Node and `npm ci`; its absence must not fail CI.
            Err(err) => {
                eprintln!("peer skipped: {err:#}");
                r["peer"] = json!({ "skipped": format!("{err:#}") });
            }
        }
        clock("peer");
    }
    r["scenario_seconds"] = took;
    r["load_average"] = json!({ "start": load_start, "end": common::load_average() });
    r["seconds"] = json!(common::round2(started.elapsed().as_secs_f64()));
    Ok(r)
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Line {
        #[command(flatten)]
        args: RunArgs,
    }

    fn args(words: &[&str]) -> RunArgs {
        let argv = std::iter::once("bench").chain(words.iter().copied());
        Line::try_parse_from(argv).expect("arguments").args
    }

    #[test]
    fn only_full_runs_of_all_save_results_unless_told_where() {
        let default = results::default_dir();
        assert_eq!(args(&[]).results_dir_of("all"), Some(default));
        assert_eq!(args(&[]).results_dir_of("dispatch"), None);
        // CI's quick run leaves the repository alone.
        assert_eq!(args(&["--quick"]).results_dir_of("all"), None);
        assert_eq!(
            args(&["--quick", "--results-dir", "/tmp/r"]).results_dir_of("all"),
            Some(PathBuf::from("/tmp/r"))
        );
        assert_eq!(args(&["--no-results"]).results_dir_of("all"), None);
    }
}

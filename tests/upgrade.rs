//! A rolling upgrade, tested: the previous release's bridge and this build's side by side
//! on one Redis and one broker under load, with recurring, parked and paused jobs; then
//! the old one stops (SIGTERM, as a rolling upgrade does) and the new one carries on.
//! The promise: 0 lost, 0 early, 0 delivered after an applied delete, every series still
//! on its grid, and nothing left stuck that needs a manual step the new release alone
//! would not need (parked jobs wait for a re-drive by design; they must stay parked,
//! readable and re-drivable across versions).
//!
//! The previous release is the commit recorded in `tests/fixtures/previous-release`,
//! built once per machine by `scripts/previous-release-deps.sh` (the test command runs it
//! first; this test runs it too if the binary is missing).

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::bridge::*;
use common::faults::*;
use lapin::options::QueueBindOptions;
use lapin::types::{AMQPValue, FieldTable};
use redisched::config::Config;
use redisched::job::{JobId, Topic};
use redisched::store::JobState;
use tokio_util::sync::CancellationToken;

const SECOND: Duration = Duration::from_secs(1);
/// The series' interval: long enough that load on a shared CI machine never makes an
/// occurrence late by a whole interval (which coalescing would turn into a gap).
const EVERY_MS: i64 = 2_000;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The previous release's binary, built (once per machine) if it is not there yet.
fn previous_release() -> PathBuf {
    let script = repo().join("scripts/previous-release-deps.sh");
    let built = Command::new("bash")
        .arg(&script)
        .status()
        .expect("run scripts/previous-release-deps.sh");
    assert!(
        built.success(),
        "building the previous release failed: run `bash scripts/previous-release-deps.sh` to see why"
    );
    let out = Command::new("bash")
        .arg(&script)
        .arg("--print-path")
        .output()
        .expect("ask for the previous release's path");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The `REDISCHED_*` names a binary knows: its own defaults, printed by `check-config`.
/// The config loader is strict, so an older binary must not get names it never had.
fn known_names(bin: &Path) -> BTreeSet<String> {
    let out = Command::new(bin)
        .args(["check-config", "--json"])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .output()
        .expect("run check-config");
    assert!(out.status.success(), "check-config failed: {out:?}");
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("config JSON");
    let mut names = BTreeSet::new();
    for (section, keys) in value.as_object().expect("sections") {
        for key in keys.as_object().map(|k| k.keys()).into_iter().flatten() {
            names.insert(format!("REDISCHED_{section}__{key}").to_uppercase());
        }
    }
    names
}

/// Names of what only this release uses, isolated per test like every name: the old
/// release never sets a job aside as expired, so it needs no expired exchange.
const NEW_RELEASE_ONLY: [&str; 2] = [
    "REDISCHED_AMQP__EXPIRED_EXCHANGE",
    "REDISCHED_AMQP__EXPIRED_QUEUE",
];

/// The settings of `config` that `bin` knows. A key the old release lacks must be at its
/// default in this test, or the two bridges would not run the same configuration.
fn env_known_to(bin: &Path, config: &Config) -> Vec<(String, String)> {
    let known = known_names(bin);
    let defaults: HashMap<String, String> = Config::default().to_env().into_iter().collect();
    let mut env = Vec::new();
    for (name, value) in config.to_env() {
        if known.contains(&name) {
            env.push((name, value));
        } else if NEW_RELEASE_ONLY.contains(&name.as_str()) {
            continue;
        } else {
            assert_eq!(
                defaults.get(&name),
                Some(&value),
                "{name} is new since the previous release and not at its default in this test"
            );
        }
    }
    env
}

fn spawn_old_bridge(bin: &Path, env: &[(String, String)], log: &Path) -> ChildBridge {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("old bridge log");
    let err = out.try_clone().expect("old bridge log");
    let child = Command::new(bin)
        .arg("run")
        .envs(env.iter().cloned())
        .env("REDISCHED_LOG__LEVEL", "redisched=info,lapin=error")
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("spawn the previous release's bridge");
    ChildBridge(redisched_testkit::ChildBridge { child })
}

/// Runs an operator command of `bin` with `env`; panics with its output on failure.
fn cli(bin: &Path, env: &[(String, String)], args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .envs(env.iter().cloned())
        .output()
        .expect("run the CLI");
    assert!(
        out.status.success(),
        "`{} {}` failed: {}{}",
        bin.display(),
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn wait_until(what: &str, timeout: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until all 20 p.0 jobs are parked; panics with what it saw after 20 s.
async fn wait_parked(store: &common::TestStore, topic: &Topic, logs: &Path) {
    let deadline = Instant::now() + 20 * SECOND;
    while store.stats(topic).await.map(|s| s.parked).unwrap_or(0) != 20 {
        if Instant::now() > deadline {
            panic!(
                "p.0 jobs not all parked within 20 s: {}",
                parking_report(store, topic, logs).await
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What a failed parking wait needs to be understood: the topic's counts, each job's
/// state and last error, and both bridges' last log lines.
async fn parking_report(store: &common::TestStore, topic: &Topic, logs: &Path) -> String {
    let mut report = format!("{:?}\n", store.stats(topic).await);
    for n in 0..20 {
        let id = JobId::new(format!("parked-{n}")).unwrap();
        match store.get(topic, &id).await {
            Ok(Some(job)) => {
                report += &format!(
                    "  {id}: {:?} attempts {} failures {} due {} last error {:?}\n",
                    job.state, job.attempts, job.failures, job.due_at, job.last_error
                )
            }
            other => report += &format!("  {id}: {other:?}\n"),
        }
    }
    for log in ["old.log", "new.log"] {
        report += &format!("--- {log}\n{}\n", tail(&logs.join(log), 30));
    }
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: bash scripts/test.sh runs it"]
async fn old_and_new_bridges_side_by_side_then_the_old_one_stops() {
    init_logging();
    let old_bin = previous_release();
    let new_bin = PathBuf::from(env!("CARGO_BIN_EXE_redisched"));
    let logs = TempDir::new("upgrade");

    let mut config = fault_config("upgrade");
    config.dispatch.max_attempts = 3;
    config.dispatch.retry_min_ms = 100;
    config.dispatch.retry_max_ms = 300;
    let amqp = common::amqp_url();
    let _cleanup = AmqpCleanup {
        url: amqp.clone(),
        config: config.clone(),
    };
    let old_env = env_known_to(&old_bin, &config);
    let new_env = config.to_env();
    let store = common::TestStore {
        store: common::test_store_named(&config.redis.prefix).await,
        prefix: config.redis.prefix.clone(),
    };

    // Topics: f.* the steady load (ledger), r.0 recurring, z.0 paused, p.0 unroutable
    // until the end (its jobs park after max_attempts), all others as the load gives.
    let collector = Collector::start_bound(&amqp, &config, &["f.#", "r.#", "z.#"]).await;
    let broker = Broker::new(&config).await;
    let (paused, parking) = (Topic::new("z.0").unwrap(), Topic::new("p.0").unwrap());

    // The old release pauses a topic; the new one will resume it.
    cli(&old_bin, &old_env, &["pause", "z.0"]);

    let mut old = spawn_old_bridge(&old_bin, &old_env, &logs.path().join("old.log"));
    let old_pid = old.pid();

    // Parked by the old release, first and alone: every p.0 job fails max_attempts
    // times and waits. Alone, because releases before the return matching of
    // src/dispatch/confirm.rs paired a return with whichever confirm came next, and
    // with other jobs in flight could release an unroutable job as delivered.
    let mut extra: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for n in 0..20 {
        let id = format!("parked-{n}");
        extra.insert(id.clone(), (now_ms(), 0));
        broker.put("p.0", &id, b"park me", &[]).await;
    }
    wait_parked(&store, &parking, logs.path()).await;

    let series: Vec<String> = (0..4).map(|n| format!("series-{n}")).collect();
    for id in &series {
        broker
            .put(
                "r.0",
                id,
                b"tick",
                &[("x-redisched-every", AMQPValue::LongLongInt(EVERY_MS))],
            )
            .await;
    }
    for n in 0..50 {
        let (id, delay) = (format!("paused-{n}"), (n % 10) * 200);
        extra.insert(id.clone(), (now_ms(), delay));
        broker
            .put(
                "z.0",
                &id,
                b"wait",
                &[("x-delay", AMQPValue::LongLongInt(delay))],
            )
            .await;
    }

    // Steady load. The old bridge alone first: it ingests and delivers.
    let stop = CancellationToken::new();
    let load = spawn_load(
        Producer::new(&amqp, &config),
        20,
        3_000,
        Duration::from_millis(50),
        stop.clone(),
    );
    wait_until(
        "deliveries by the old bridge alone",
        20 * SECOND,
        async || collector.count() >= 100,
    )
    .await;
    // Then both: the old one keeps the single active ingest consumer, both dispatch,
    // each the other's writes too.
    let mut new = spawn_bridge(&config, &logs.path().join("new.log"));
    tokio::time::sleep(10 * SECOND).await;

    // Parked across versions: still all parked with both bridges running.
    wait_parked(&store, &parking, logs.path()).await;
    let parked = store
        .get(&parking, &JobId::new("parked-0").unwrap())
        .await
        .expect("get")
        .expect("parked job kept");
    assert_eq!(parked.state, JobState::Parked);
    assert_eq!(parked.body, b"park me");
    // Paused across versions: nothing of z.0 went out.
    assert!(collector.count() > 0, "the load is delivered");
    let z_seen = collector
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.topic == "z.0")
        .count();
    assert_eq!(z_seen, 0, "a topic paused by the old release delivered");
    assert!(store.is_paused(&paused).await.expect("is_paused"));

    // The rolling step: SIGTERM the old bridge; the new one takes over ingest.
    let switched_at = now_ms();
    let (status, took) = old.terminate();
    assert!(status.success(), "the old bridge exited with {status}");
    println!("[upgrade] old bridge (pid {old_pid}) stopped in {took:?}");
    tokio::time::sleep(8 * SECOND).await;
    stop.cancel();
    let mut producer = load.await.expect("load task");
    producer.close().await;
    let mut ledger = std::mem::take(&mut *producer.ledger.lock().unwrap());

    // The new release re-drives what parked under both and resumes what the old paused.
    let channel = broker.connection.create_channel().await.expect("channel");
    channel
        .queue_bind(
            collector.queue().into(),
            config.amqp.ready_exchange.as_str().into(),
            "p.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind p.#");
    cli(&new_bin, &new_env, &["redrive", "p.0"]);
    cli(&new_bin, &new_env, &["resume", "z.0"]);
    ledger.accepted.extend(extra);

    let complete = collector.wait_for_all(&ledger, 60 * SECOND).await;
    // End the series (deletes through the commands queue, applied by the new bridge).
    for id in &series {
        broker
            .put("r.0", id, b"", &[("x-redisched-op", text("delete"))])
            .await;
    }
    for id in &series {
        let id = JobId::new(id).unwrap();
        let topic = Topic::new("r.0").unwrap();
        wait_until("series deleted", 20 * SECOND, async || {
            matches!(store.get(&topic, &id).await, Ok(None))
        })
        .await;
    }
    tokio::time::sleep(2 * SECOND).await;
    let seen = collector.stop().await;

    // Every series went on, on its grid, across the switch: consecutive occurrences
    // exactly one interval apart (no occurrence lost or coalesced, no second chain).
    for id in &series {
        let due: BTreeSet<i64> = seen
            .iter()
            .filter(|s| &s.id == id)
            .filter_map(|s| s.due_at)
            .collect();
        let due: Vec<i64> = due.into_iter().collect();
        let gaps: BTreeSet<i64> = due.windows(2).map(|w| w[1] - w[0]).collect();
        println!("[upgrade] {id}: {} occurrences, gaps {gaps:?}", due.len());
        assert!(due.len() >= 10, "{id}: only {} occurrences", due.len());
        assert_eq!(
            gaps,
            BTreeSet::from([EVERY_MS]),
            "{id}: an occurrence was lost, coalesced or doubled across the upgrade: {due:?}"
        );
        assert!(
            due.iter().any(|&d| d > switched_at),
            "{id}: no occurrence after the old bridge stopped"
        );
    }
    let one_shots: Vec<Seen> = seen.into_iter().filter(|s| s.topic != "r.0").collect();
    let report = verify("upgrade", &ledger, &one_shots);
    assert!(complete || !report.lost.is_empty());
    assert_promise(
        &report,
        dup_bound(&config, 1),
        &tail(&logs.path().join("old.log"), 20),
    );

    // Nothing stuck: every topic is empty and the store is sound by both releases' check.
    let topics = store.topics().await.expect("topics");
    for topic in &topics {
        let stats = store.stats(topic).await.expect("stats");
        assert_eq!(
            (stats.scheduled, stats.reserved, stats.parked, stats.records),
            (0, 0, 0, 0),
            "{topic} still holds jobs: {stats:?}"
        );
        assert!(!stats.paused, "{topic} still paused");
    }
    cli(&new_bin, &new_env, &["check"]);
    cli(&old_bin, &old_env, &["check"]);
    let (status, _) = new.terminate();
    assert!(status.success(), "the new bridge exited with {status}");
}

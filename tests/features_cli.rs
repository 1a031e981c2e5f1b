//! The scheduler features (issue 10) through the `redisched` binary against a real Redis
//! (and RabbitMQ where a bridge dispatches): pause and resume with another topic flowing,
//! redrive of parked jobs, the outcome history, recurring puts (`--every`, `--cron`), and
//! `get`/`list`/`stats` showing schedules, failures and parked jobs.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::bridge::{self, Broker, InProcess};
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::schedule::Schedule;
use redisched::store::{Lease, PutRequest, RetryOutcome, Store};
use serde_json::Value;

/// Runs the binary on one key prefix, with no `REDISCHED_*` variable leaking in from the
/// test environment.
struct Cli {
    prefix: String,
    /// Deletes the prefix's keys on drop unless a bridge's cleanup does.
    owns_prefix: bool,
}

impl Cli {
    fn new() -> Self {
        Self {
            prefix: common::unique("fcli"),
            owns_prefix: true,
        }
    }

    /// A CLI on a bridge's prefix (the bridge test cleans it up).
    fn on(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
            owns_prefix: false,
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_redisched"));
        for (key, _) in std::env::vars() {
            if key.starts_with("REDISCHED_") || key == "RUST_LOG" {
                cmd.env_remove(key);
            }
        }
        cmd.env("REDISCHED_REDIS__URL", common::redis_url())
            .env("REDISCHED_REDIS__PREFIX", &self.prefix)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run redisched")
    }

    /// Runs, expects exit code 0; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", describe(&out));
        String::from_utf8(out.stdout).expect("utf-8 stdout")
    }

    /// Runs with `--json`, expects exit code 0; returns the parsed stdout.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        let stdout = self.ok(&all);
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
    }

    /// Runs, expects exit code `code`; returns stderr.
    fn fails(&self, args: &[&str], code: i32) -> String {
        let out = self.run(args);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{args:?}: {}",
            describe(&out)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    async fn store(&self) -> Store {
        common::test_store_named(&self.prefix).await
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        if self.owns_prefix {
            common::delete_prefix(&self.prefix);
        }
    }
}

fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn topic(name: &str) -> Topic {
    Topic::new(name).unwrap()
}

/// Puts a job due now straight into the store.
async fn put_now(store: &Store, topic_name: &str, id: &str) {
    store
        .put(PutRequest {
            topic: topic(topic_name),
            id: JobId::new(id).unwrap(),
            body: b"payload".to_vec(),
            meta: Vec::new(),
            due: Due::NOW,
            mode: PutMode::Keep,
        })
        .await
        .unwrap();
}

/// Reserves every due job of the topic, as a dispatcher does before publishing.
async fn reserve_all(store: &Store, topic_name: &str) -> Vec<Lease> {
    let batch = store
        .reserve(&topic(topic_name), Duration::from_secs(30), 100)
        .await
        .unwrap();
    batch
        .jobs
        .iter()
        .map(|job| Lease {
            topic: topic(topic_name),
            id: job.id.clone(),
            token: job.token,
        })
        .collect()
}

/// Records a failed publish of the reserved job `id`, as the dispatcher does; parks it
/// when `max_attempts` (0 = never) is reached.
async fn fail(store: &Store, leases: &[Lease], id: &str, max_attempts: u32) -> RetryOutcome {
    let lease = leases
        .iter()
        .find(|lease| lease.id == id)
        .unwrap_or_else(|| panic!("{id} was not reserved"));
    store
        .retry_failed(lease, Duration::ZERO, "unroutable: NO_ROUTE", max_attempts)
        .await
        .unwrap()
}

#[tokio::test]
async fn pause_and_resume_through_the_cli_while_another_topic_flows() {
    let config = bridge::test_config("fpause");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let cli = Cli::on(&config.redis.prefix);
    // Pausing a topic that has no jobs yet works.
    let paused = cli.json(&["pause", "held"]);
    assert_eq!(paused["paused"], true);
    assert_eq!(paused["changed"], true);
    assert!(cli
        .ok(&["pause", "held"])
        .contains("topic held was paused already"));
    let bridge = InProcess::start(&config);

    for n in 0..3 {
        broker.put("held", &format!("h{n}"), b"held", &[]).await;
        broker
            .put("flowing", &format!("f{n}"), b"flowing", &[])
            .await;
    }
    let got = ready.collect(3, Duration::from_secs(15)).await;
    let ids: Vec<String> = got.iter().map(|(_, d)| bridge::message_id(d)).collect();
    assert_eq!(
        ids.len(),
        3,
        "the other topic flows while one is paused: {ids:?}"
    );
    assert!(ids.iter().all(|id| id.starts_with('f')), "{ids:?}");
    let late = ready.drain(Duration::from_millis(1500)).await;
    assert!(late.is_empty(), "nothing of the paused topic is dispatched");

    // Commands for the paused topic were applied; the jobs wait.
    let stats = cli.json(&["stats", "held"]);
    let row = &stats["topics"][0];
    assert_eq!(row["paused"], true, "{stats}");
    assert_eq!(row["scheduled"], 3, "{stats}");
    assert_eq!(row["due_now"], 3, "{stats}");
    let human = cli.ok(&["stats"]);
    let held = human.lines().find(|l| l.starts_with("held")).unwrap();
    assert!(held.trim_end().ends_with("yes"), "{human}");
    assert!(human.lines().next().unwrap().contains("PAUSED"), "{human}");

    let resumed = cli.json(&["resume", "held"]);
    assert_eq!(
        (&resumed["paused"], &resumed["changed"]),
        (&Value::Bool(false), &Value::Bool(true))
    );
    let got = ready.collect(3, Duration::from_secs(15)).await;
    let mut ids: Vec<String> = got.iter().map(|(_, d)| bridge::message_id(d)).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["h0", "h1", "h2"],
        "the backlog is dispatched on resume"
    );
    assert!(cli.ok(&["resume", "held"]).contains("was not paused"));
    assert_eq!(cli.json(&["stats", "held"])["topics"][0]["paused"], false);

    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn failing_and_parked_jobs_show_and_redrive_through_the_cli() {
    let cli = Cli::new();
    let store = cli.store().await;
    for id in ["p1", "p2", "f1", "ok"] {
        put_now(&store, "jobs", id).await;
    }
    let leases = reserve_all(&store, "jobs").await;
    assert_eq!(leases.len(), 4);
    assert_eq!(fail(&store, &leases, "p1", 1).await, RetryOutcome::Parked);
    assert_eq!(fail(&store, &leases, "p2", 1).await, RetryOutcome::Parked);
    // Retried forever (max_attempts 0): failing, not parked.
    assert_eq!(fail(&store, &leases, "f1", 0).await, RetryOutcome::Retried);
    // `ok` is handed back without a failure (as after a requeue).
    let ok = leases.iter().find(|lease| lease.id == "ok").unwrap();
    assert!(store.retry(ok, Duration::ZERO).await.unwrap());

    let job = cli.json(&["get", "jobs", "p1"]);
    assert_eq!(job["state"], "parked", "{job}");
    assert_eq!(job["last_error"], "unroutable: NO_ROUTE");
    assert!(
        job["last_error_at"].as_i64().unwrap() > 1_600_000_000_000,
        "{job}"
    );
    assert_eq!(job["failures"], 1);
    assert_eq!(job["body"], "payload", "a parked job keeps its body");
    let human = cli.ok(&["get", "jobs", "p1"]);
    assert!(
        human.starts_with("!! PARKED after 1 failed publish(es)"),
        "{human}"
    );
    assert!(human.contains("redisched redrive jobs p1"), "{human}");
    assert!(
        human.contains("last error unroutable: NO_ROUTE at "),
        "{human}"
    );
    let human = cli.ok(&["get", "jobs", "f1"]);
    assert!(
        human.starts_with("!! FAILING: 1 failed publish(es), last unroutable: NO_ROUTE"),
        "{human}"
    );
    assert!(human.contains("state     scheduled"), "{human}");
    let fine = cli.json(&["get", "jobs", "ok"]);
    assert_eq!(fine["last_error"], Value::Null);
    assert!(!cli.ok(&["get", "jobs", "ok"]).contains("!!"));

    // list: waiting jobs with their failure; --parked the parked ones.
    let list = cli.json(&["list", "jobs"]);
    let rows = list["jobs"].as_array().unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert!(
        ids.contains(&"f1") && ids.contains(&"ok") && !ids.contains(&"p1"),
        "{list}"
    );
    let f1 = rows.iter().find(|r| r["id"] == "f1").unwrap();
    assert_eq!(f1["last_error"], "unroutable: NO_ROUTE");
    assert_eq!(f1["state"], "scheduled");
    let human = cli.ok(&["list", "jobs"]);
    let f1_line = human.lines().find(|l| l.starts_with("f1")).unwrap();
    assert!(
        f1_line.contains("!! unroutable: NO_ROUTE (1 failure(s)"),
        "{human}"
    );
    let ok_line = human.lines().find(|l| l.starts_with("ok")).unwrap();
    assert!(!ok_line.contains("!!"), "{human}");
    let parked = cli.json(&["list", "jobs", "--parked"]);
    let ids: Vec<&str> = parked["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["p1", "p2"]);
    assert_eq!(parked["jobs"][0]["state"], "parked");
    let human = cli.ok(&["list", "jobs", "--parked"]);
    assert!(human.lines().nth(1).unwrap().contains("parked"), "{human}");

    let stats = &cli.json(&["stats", "jobs"])["topics"][0];
    assert_eq!(
        (&stats["parked"], &stats["failing"], &stats["scheduled"]),
        (&Value::from(2), &Value::from(3), &Value::from(2)),
        "{stats}"
    );

    // Redrive one: due now, attempts kept; again: not parked (exit 1).
    let attempts_before = cli.json(&["get", "jobs", "p1"])["attempts"].clone();
    let redriven = cli.json(&["redrive", "jobs", "p1"]);
    assert_eq!(
        (&redriven["id"], &redriven["redriven"]),
        (&Value::from("p1"), &Value::from(1))
    );
    let job = cli.json(&["get", "jobs", "p1"]);
    assert_eq!(job["state"], "scheduled");
    assert_eq!(job["attempts"], attempts_before);
    let now = store.server_time().await.unwrap();
    assert!(job["due_at"].as_i64().unwrap() <= now, "due now: {job}");
    let err = cli.fails(&["redrive", "jobs", "p1"], 1);
    assert!(
        err.contains("job p1 in topic jobs is not parked (it is scheduled)"),
        "{err}"
    );
    let err = cli.fails(&["redrive", "jobs", "nope"], 1);
    assert!(err.contains("no job nope in topic jobs"), "{err}");

    // Redrive the topic: every parked job.
    let out = cli.ok(&["redrive", "jobs"]);
    assert!(
        out.contains("re-drove 1 parked job(s) of topic jobs"),
        "{out}"
    );
    assert_eq!(cli.json(&["stats", "jobs"])["topics"][0]["parked"], 0);
    assert_eq!(cli.json(&["redrive", "jobs"])["redriven"], 0);

    let history = cli.json(&["history", "jobs"]);
    let outcomes: Vec<(&str, &str)> = history["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["outcome"].as_str().unwrap(), e["id"].as_str().unwrap()))
        .collect();
    assert_eq!(
        outcomes,
        [
            ("re-driven", "p2"),
            ("re-driven", "p1"),
            ("parked", "p2"),
            ("parked", "p1")
        ],
        "{history}"
    );
    assert_eq!(history["entries"][3]["detail"], "unroutable: NO_ROUTE");
}

#[tokio::test]
async fn history_lists_dispatched_and_deleted_outcomes() {
    let cli = Cli::new();
    let store = cli.store().await;
    let out = cli.ok(&["history", "h"]);
    assert_eq!(out.trim(), "no history in topic h");
    put_now(&store, "h", "sent").await;
    let batch = store
        .reserve(&topic("h"), Duration::from_secs(30), 10)
        .await
        .unwrap();
    let lease = Lease {
        topic: topic("h"),
        id: batch.jobs[0].id.clone(),
        token: batch.jobs[0].token,
    };
    assert_eq!(store.release(&[lease]).await.unwrap(), 1);
    cli.ok(&["put", "h", "gone", "x", "--delay", "1h"]);
    cli.ok(&["delete", "h", "gone"]);

    let history = cli.json(&["history", "h"]);
    assert_eq!(history["topic"], "h");
    assert!(history.get("id").is_none(), "{history}");
    let entries = history["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{history}");
    assert_eq!(
        (&entries[0]["outcome"], &entries[0]["id"]),
        (&Value::from("deleted"), &Value::from("gone"))
    );
    assert_eq!(
        (&entries[1]["outcome"], &entries[1]["id"]),
        (&Value::from("dispatched"), &Value::from("sent"))
    );
    assert_eq!(entries[1]["attempts"], 1);
    assert_eq!(entries[1]["due_at"], batch.jobs[0].due_at);
    assert!(
        entries[0]["at"].as_i64() >= entries[1]["at"].as_i64(),
        "newest first"
    );

    let one = cli.json(&["history", "h", "sent"]);
    assert_eq!(one["id"], "sent");
    assert_eq!(one["entries"].as_array().unwrap().len(), 1);
    let limited = cli.json(&["history", "h", "--limit", "1"]);
    assert_eq!(limited["entries"].as_array().unwrap().len(), 1);
    assert_eq!(limited["entries"][0]["outcome"], "deleted");
    let err = cli.fails(&["history", "h", "--limit", "0"], 2);
    assert!(err.contains("--limit must be 1..=1000"), "{err}");

    let human = cli.ok(&["history", "h"]);
    let lines: Vec<&str> = human.lines().collect();
    assert!(lines[0].starts_with("AT"), "{human}");
    assert!(
        lines[1].contains("deleted") && lines[1].contains("gone"),
        "{human}"
    );
    assert!(
        lines[2].contains("dispatched") && lines[2].contains("sent"),
        "{human}"
    );
    // GET of a job that is no longer stored stays "not found".
    cli.fails(&["get", "h", "sent"], 1);
}

#[tokio::test]
async fn recurring_puts_store_their_spec_and_first_due_time() {
    let cli = Cli::new();
    let store = cli.store().await;

    let before = store.server_time().await.unwrap();
    let put = cli.json(&["put", "r", "every", "tick", "--every", "15m"]);
    let after = store.server_time().await.unwrap();
    assert_eq!(put["status"], "scheduled");
    let due = put["due_at"].as_i64().unwrap();
    assert!(
        (before + 900_000..=after + 900_000).contains(&due),
        "now + interval: {put}"
    );
    let job = cli.json(&["get", "r", "every"]);
    assert_eq!(job["every_ms"], 900_000, "{job}");
    assert!(job.get("cron").is_none(), "{job}");
    let human = cli.ok(&["get", "r", "every"]);
    assert!(human.contains("schedule  every 15m"), "{human}");
    assert!(human.contains("next due  "), "{human}");

    // Milliseconds work too; --delay gives the first occurrence.
    let before = store.server_time().await.unwrap();
    let put = cli.json(&["put", "r", "ms", "--every", "900000", "--delay", "5s"]);
    let due = put["due_at"].as_i64().unwrap();
    assert!((before + 5_000..before + 15_000).contains(&due), "{put}");
    assert_eq!(cli.json(&["get", "r", "ms"])["every_ms"], 900_000);

    // Cron in a zone, first match at or after --at: 2030-01-01 is a Tuesday, 09:00 in
    // Berlin is 08:00 UTC in winter.
    let put = cli.json(&[
        "put",
        "r",
        "standup",
        "--cron",
        "0 9 * * MON-FRI",
        "--tz",
        "Europe/Berlin",
        "--at",
        "2030-01-01T00:00:00Z",
    ]);
    assert_eq!(put["due_at_rfc3339"], "2030-01-01T08:00:00.000Z", "{put}");
    let job = cli.json(&["get", "r", "standup"]);
    assert_eq!(
        (&job["cron"], &job["tz"]),
        (
            &Value::from("0 9 * * MON-FRI"),
            &Value::from("Europe/Berlin")
        )
    );
    assert!(job.get("every_ms").is_none(), "{job}");

    // Cron without a first time: the next match after now (UTC by default).
    let schedule = Schedule::cron("*/10 * * * *", None).unwrap();
    let before = store.server_time().await.unwrap();
    let put = cli.json(&["put", "r", "tenmin", "--cron", "*/10 * * * *"]);
    let after = store.server_time().await.unwrap();
    let due = put["due_at"].as_i64().unwrap();
    let (earliest, latest) = (
        schedule.next_after(before).unwrap(),
        schedule.next_after(after).unwrap(),
    );
    assert!(
        (earliest..=latest).contains(&due),
        "{due} in {earliest}..={latest}"
    );
    assert_eq!(cli.json(&["get", "r", "tenmin"])["tz"], "UTC");

    let list = cli.ok(&["list", "r"]);
    assert!(list.contains("every 15m"), "{list}");
    assert!(
        list.contains("cron 0 9 * * MON-FRI (Europe/Berlin)"),
        "{list}"
    );
    let rows = cli.json(&["list", "r"]);
    let standup = rows["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == "standup")
        .unwrap();
    assert_eq!(standup["cron"], "0 9 * * MON-FRI");

    // Replace changes the spec; a replace without one makes the job one-shot again.
    cli.ok(&["put", "r", "every", "--every", "1h", "--replace"]);
    assert_eq!(cli.json(&["get", "r", "every"])["every_ms"], 3_600_000);
    cli.ok(&["put", "r", "every", "--delay", "1h", "--replace"]);
    assert!(cli.json(&["get", "r", "every"]).get("every_ms").is_none());

    // Bad specs: exit 2 with a clear reason; nothing is stored.
    for (args, reason) in [
        (
            &["--every", "10ms"][..],
            "below the minimum of 1000 ms (limits.min_interval_ms)",
        ),
        (&["--every", "soon"], "neither milliseconds nor a duration"),
        (&["--cron", "0 9 * *"], "expected 5"),
        (&["--cron", "0 99 * * *"], "is invalid"),
        (&["--cron", "0 0 30 2 *"], "never fires"),
        (
            &["--cron", "0 9 * * *", "--tz", "Mars/Olympus"],
            "unknown time zone",
        ),
        (&["--tz", "UTC"], "--cron"),
        (
            &["--every", "1m", "--cron", "* * * * *"],
            "cannot be used with",
        ),
    ] {
        let mut all = vec!["put", "r", "bad"];
        all.extend_from_slice(args);
        let err = cli.fails(&all, 2);
        assert!(err.contains(reason), "{args:?}: {err}");
    }
    cli.fails(&["get", "r", "bad"], 1);
}

//! The scheduler features through the `redisched` binary against a real Redis
//! (and RabbitMQ where a bridge dispatches): pause and resume with another topic flowing,
//! redrive of parked jobs, the outcome history, recurring puts (`--every`, `--cron`), and
//! `get`/`list`/`stats` showing schedules, failures and parked jobs.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use redisched::job::schedule::Schedule;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{Lease, PutRequest, RetryOutcome, Store};
use serde_json::Value;

/// The command line, parsed and executed in-process exactly as the binary's `main` does
/// (`Cli::parse`, `cli::execute`, `Output::render`, the exit code of the error), with a
/// config file naming this test's Redis and key prefix. In-process because the test
/// binaries of several worktrees share one target directory, where `redisched` itself
/// may be another branch's build at any moment.
pub(crate) struct Cli {
    prefix: String,
    config: PathBuf,
    /// Deletes the prefix's keys on drop unless a bridge's cleanup does.
    owns_prefix: bool,
}

/// What a command run gave: exit code, stdout, stderr.
struct Run {
    code: u8,
    stdout: String,
    stderr: String,
}

impl Cli {
    fn new() -> Self {
        let mut cli = Self::on(&common::unique("fcli"));
        cli.owns_prefix = true;
        cli
    }

    /// A CLI on a bridge's prefix (the bridge test cleans it up).
    pub(crate) fn on(prefix: &str) -> Self {
        let config = std::env::temp_dir().join(format!("{}.toml", common::unique("fcli-config")));
        let toml = format!(
            "[redis]\nurl = {:?}\nprefix = {:?}\n",
            common::redis_url(),
            prefix
        );
        std::fs::write(&config, toml).expect("write the test config");
        Self {
            prefix: prefix.to_string(),
            config,
            owns_prefix: false,
        }
    }

    async fn run(&self, args: &[&str]) -> Run {
        let config = self.config.to_string_lossy().into_owned();
        let argv = ["redisched", "--config", config.as_str()]
            .into_iter()
            .chain(args.iter().copied());
        let cli = match redisched::cli::Cli::try_parse_from(argv) {
            Ok(cli) => cli,
            Err(err) => {
                return Run {
                    code: u8::try_from(err.exit_code()).unwrap_or(255),
                    stdout: String::new(),
                    stderr: err.to_string(),
                }
            }
        };
        match redisched::cli::execute(&cli).await {
            Ok(output) => Run {
                code: 0,
                stdout: output.render(cli.json),
                stderr: String::new(),
            },
            Err(err) => Run {
                code: err.exit_code(),
                stdout: if cli.json {
                    err.to_json().to_string()
                } else {
                    String::new()
                },
                stderr: format!("error: {err}"),
            },
        }
    }

    /// Runs, expects exit code 0; returns stdout.
    pub(crate) async fn ok(&self, args: &[&str]) -> String {
        let run = self.run(args).await;
        assert_eq!(
            run.code, 0,
            "{args:?}: stdout {}\nstderr {}",
            run.stdout, run.stderr
        );
        run.stdout
    }

    /// Runs with `--json`, expects exit code 0; returns the parsed stdout.
    pub(crate) async fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        let stdout = self.ok(&all).await;
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
    }

    /// Runs, expects exit code `code`; returns stderr.
    async fn fails(&self, args: &[&str], code: u8) -> String {
        let run = self.run(args).await;
        assert_eq!(
            run.code, code,
            "{args:?}: stdout {}\nstderr {}",
            run.stdout, run.stderr
        );
        run.stderr
    }

    async fn store(&self) -> Store {
        common::test_store_named(&self.prefix).await
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
        if self.owns_prefix {
            common::delete_prefix(&self.prefix);
        }
    }
}

/// `due` is the first weekday 09:00 in Europe/Berlin at or after `start` (epoch ms).
fn assert_berlin_weekday_nine(due: i64, start: i64) {
    use chrono::{Datelike, TimeZone, Timelike, Weekday};
    let local = chrono_tz::Europe::Berlin.timestamp_millis_opt(due).unwrap();
    assert_eq!(
        (local.hour(), local.minute(), local.second()),
        (9, 0, 0),
        "{local}"
    );
    assert!(
        !matches!(local.weekday(), Weekday::Sat | Weekday::Sun),
        "{local}"
    );
    assert!(
        due >= start && due - start < 4 * 86_400_000,
        "{local} from {start}"
    );
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

    let job = cli.json(&["get", "jobs", "p1"]).await;
    assert_eq!(job["state"], "parked", "{job}");
    assert_eq!(job["last_error"], "unroutable: NO_ROUTE");
    assert!(
        job["last_error_at"].as_i64().unwrap() > 1_600_000_000_000,
        "{job}"
    );
    assert_eq!(job["failures"], 1);
    assert_eq!(job["body"], "payload", "a parked job keeps its body");
    let human = cli.ok(&["get", "jobs", "p1"]).await;
    assert!(
        human.starts_with("!! PARKED after 1 failed publish(es)"),
        "{human}"
    );
    assert!(human.contains("redisched redrive jobs p1"), "{human}");
    assert!(
        human.contains("last error unroutable: NO_ROUTE at "),
        "{human}"
    );
    let human = cli.ok(&["get", "jobs", "f1"]).await;
    assert!(
        human.starts_with("!! FAILING: 1 failed publish(es), last unroutable: NO_ROUTE"),
        "{human}"
    );
    assert!(human.contains("state     scheduled"), "{human}");
    let fine = cli.json(&["get", "jobs", "ok"]).await;
    assert_eq!(fine["last_error"], Value::Null);
    assert!(!cli.ok(&["get", "jobs", "ok"]).await.contains("!!"));

    // list: waiting jobs with their failure; --parked the parked ones.
    let list = cli.json(&["list", "jobs"]).await;
    let rows = list["jobs"].as_array().unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert!(
        ids.contains(&"f1") && ids.contains(&"ok") && !ids.contains(&"p1"),
        "{list}"
    );
    let f1 = rows.iter().find(|r| r["id"] == "f1").unwrap();
    assert_eq!(f1["last_error"], "unroutable: NO_ROUTE");
    assert_eq!(f1["state"], "scheduled");
    let human = cli.ok(&["list", "jobs"]).await;
    let f1_line = human.lines().find(|l| l.starts_with("f1")).unwrap();
    assert!(
        f1_line.contains("!! unroutable: NO_ROUTE (1 failure(s)"),
        "{human}"
    );
    let ok_line = human.lines().find(|l| l.starts_with("ok")).unwrap();
    assert!(!ok_line.contains("!!"), "{human}");
    let parked = cli.json(&["list", "jobs", "--parked"]).await;
    let ids: Vec<&str> = parked["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["p1", "p2"]);
    assert_eq!(parked["jobs"][0]["state"], "parked");
    let human = cli.ok(&["list", "jobs", "--parked"]).await;
    assert!(human.lines().nth(1).unwrap().contains("parked"), "{human}");

    let stats = &cli.json(&["stats", "jobs"]).await["topics"][0];
    assert_eq!(
        (&stats["parked"], &stats["failing"], &stats["scheduled"]),
        (&Value::from(2), &Value::from(3), &Value::from(2)),
        "{stats}"
    );

    // Redrive one: due now, attempts kept; again: not parked (exit 1).
    let attempts_before = cli.json(&["get", "jobs", "p1"]).await["attempts"].clone();
    let redriven = cli.json(&["redrive", "jobs", "p1"]).await;
    assert_eq!(
        (&redriven["id"], &redriven["redriven"]),
        (&Value::from("p1"), &Value::from(1))
    );
    let job = cli.json(&["get", "jobs", "p1"]).await;
    assert_eq!(job["state"], "scheduled");
    assert_eq!(job["attempts"], attempts_before);
    let now = store.server_time().await.unwrap();
    assert!(job["due_at"].as_i64().unwrap() <= now, "due now: {job}");
    let err = cli.fails(&["redrive", "jobs", "p1"], 1).await;
    assert!(
        err.contains("job p1 in topic jobs is not parked (it is scheduled)"),
        "{err}"
    );
    let err = cli.fails(&["redrive", "jobs", "nope"], 1).await;
    assert!(err.contains("no job nope in topic jobs"), "{err}");

    // Redrive the topic: every parked job.
    let out = cli.ok(&["redrive", "jobs"]).await;
    assert!(
        out.contains("re-drove 1 parked job(s) of topic jobs"),
        "{out}"
    );
    assert_eq!(cli.json(&["stats", "jobs"]).await["topics"][0]["parked"], 0);
    assert_eq!(cli.json(&["redrive", "jobs"]).await["redriven"], 0);

    let history = cli.json(&["history", "jobs"]).await;
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
    let out = cli.ok(&["history", "h"]).await;
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
    cli.ok(&["put", "h", "gone", "x", "--delay", "1h"]).await;
    cli.ok(&["delete", "h", "gone"]).await;

    let history = cli.json(&["history", "h"]).await;
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

    let one = cli.json(&["history", "h", "sent"]).await;
    assert_eq!(one["id"], "sent");
    assert_eq!(one["entries"].as_array().unwrap().len(), 1);
    let limited = cli.json(&["history", "h", "--limit", "1"]).await;
    assert_eq!(limited["entries"].as_array().unwrap().len(), 1);
    assert_eq!(limited["entries"][0]["outcome"], "deleted");
    let err = cli.fails(&["history", "h", "--limit", "0"], 2).await;
    assert!(err.contains("--limit must be 1..=1000"), "{err}");

    let human = cli.ok(&["history", "h"]).await;
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
    cli.fails(&["get", "h", "sent"], 1).await;
}

#[tokio::test]
async fn recurring_puts_store_their_spec_and_first_due_time() {
    let cli = Cli::new();
    let store = cli.store().await;

    let before = store.server_time().await.unwrap();
    let put = cli
        .json(&["put", "r", "every", "tick", "--every", "15m"])
        .await;
    let after = store.server_time().await.unwrap();
    assert_eq!(put["status"], "scheduled");
    let due = put["due_at"].as_i64().unwrap();
    assert!(
        (before + 900_000..=after + 900_000).contains(&due),
        "now + interval: {put}"
    );
    let job = cli.json(&["get", "r", "every"]).await;
    assert_eq!(job["every_ms"], 900_000, "{job}");
    assert!(job.get("cron").is_none(), "{job}");
    let human = cli.ok(&["get", "r", "every"]).await;
    assert!(human.contains("schedule  every 15m"), "{human}");
    assert!(human.contains("next due  "), "{human}");

    // Milliseconds work too; --delay gives the first occurrence.
    let before = store.server_time().await.unwrap();
    let put = cli
        .json(&["put", "r", "ms", "--every", "900000", "--delay", "5s"])
        .await;
    let due = put["due_at"].as_i64().unwrap();
    assert!((before + 5_000..before + 15_000).contains(&due), "{put}");
    assert_eq!(cli.json(&["get", "r", "ms"]).await["every_ms"], 900_000);

    // Cron in a zone, first match at or after --at (a month ahead, midnight UTC): a
    // weekday at 09:00 Berlin time.
    let start = (store.server_time().await.unwrap() / 86_400_000 + 30) * 86_400_000;
    let at = redisched::view::rfc3339(start);
    let put = cli
        .json(&[
            "put",
            "r",
            "standup",
            "--cron",
            "0 9 * * MON-FRI",
            "--tz",
            "Europe/Berlin",
            "--at",
            &at,
        ])
        .await;
    let due = put["due_at"].as_i64().unwrap();
    assert_berlin_weekday_nine(due, start);
    let job = cli.json(&["get", "r", "standup"]).await;
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
    let put = cli
        .json(&["put", "r", "tenmin", "--cron", "*/10 * * * *"])
        .await;
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
    assert_eq!(cli.json(&["get", "r", "tenmin"]).await["tz"], "UTC");

    let list = cli.ok(&["list", "r"]).await;
    assert!(list.contains("every 15m"), "{list}");
    assert!(
        list.contains("cron 0 9 * * MON-FRI (Europe/Berlin)"),
        "{list}"
    );
    let rows = cli.json(&["list", "r"]).await;
    let standup = rows["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == "standup")
        .unwrap();
    assert_eq!(standup["cron"], "0 9 * * MON-FRI");

    // Replace changes the spec; a replace without one makes the job one-shot again.
    cli.ok(&["put", "r", "every", "--every", "1h", "--replace"])
        .await;
    assert_eq!(
        cli.json(&["get", "r", "every"]).await["every_ms"],
        3_600_000
    );
    cli.ok(&["put", "r", "every", "--delay", "1h", "--replace"])
        .await;
    assert!(cli
        .json(&["get", "r", "every"])
        .await
        .get("every_ms")
        .is_none());

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
        let err = cli.fails(&all, 2).await;
        assert!(err.contains(reason), "{args:?}: {err}");
    }
    cli.fails(&["get", "r", "bad"], 1).await;
}

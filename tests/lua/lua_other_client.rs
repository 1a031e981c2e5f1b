//! The scripts are the API, not the Rust crate: a second client with no Rust glue
//! (`redis-cli --eval` and `EVALSHA`, run as subprocesses) schedules, reserves and
//! releases jobs that the Rust `Store` then sees, and the other way round.

use crate::common;

use std::process::Command;
use std::time::Duration;

use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::JobState;
use redisched::store::{Lease, PutRequest};

fn lua(name: &str) -> String {
    format!("{}/lua/{name}.lua", env!("CARGO_MANIFEST_DIR"))
}

/// Runs redis-cli with `args` and returns its raw (non-tty) output, one reply element
/// per line.
fn redis_cli(args: &[&str]) -> Vec<String> {
    let output = Command::new("redis-cli")
        .arg("-u")
        .arg(common::redis_url())
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run redis-cli ({e}); it comes with Debian's redis-tools")
        });
    assert!(output.status.success(), "redis-cli {args:?}: {output:?}");
    let stdout = String::from_utf8(output.stdout).expect("utf-8 output");
    let lines: Vec<String> = stdout.lines().map(str::to_string).collect();
    assert!(
        !lines.first().is_some_and(|l| l.starts_with("ERR")
            || l.contains("_TOO_")
            || l.starts_with("INVALID")),
        "redis-cli {args:?} failed: {lines:?}"
    );
    lines
}

/// `redis-cli --eval lua/<script>.lua k1 k2 k3 k4 , args...`
fn eval(script: &str, keys: &[String; 4], args: &[&str]) -> Vec<String> {
    let path = lua(script);
    let mut argv: Vec<&str> = vec!["--eval", &path];
    argv.extend(keys.iter().map(String::as_str));
    argv.push(",");
    argv.extend_from_slice(args);
    redis_cli(&argv)
}

#[tokio::test]
async fn redis_cli_puts_reserves_and_releases_and_rust_sees_it() {
    let store = common::test_store().await;
    let topic = Topic::new("polyglot").unwrap();
    let keys = store.keys().topic(&topic).0;
    let channel = store.keys().notify_channel();

    // put from redis-cli, exactly as lua/README.md shows it.
    let reply = eval(
        "put",
        &keys,
        &[
            "cli-1",
            "made by redis-cli",
            "",
            "nx",
            "delay",
            "0",
            "1000000",
            "1000",
            &channel,
        ],
    );
    assert_eq!(reply[0], "scheduled", "{reply:?}");
    let due_at: i64 = reply[1].parse().unwrap();
    let dup = eval(
        "put",
        &keys,
        &[
            "cli-1", "other", "", "nx", "delay", "0", "1000000", "1000", "",
        ],
    );
    assert_eq!(dup, ["duplicate".to_string(), due_at.to_string()]);
    let refused = Command::new("redis-cli")
        .args(["-u", &common::redis_url(), "--eval", &lua("put")])
        .args(keys.iter())
        .args([
            ",",
            "big",
            "0123456789",
            "",
            "nx",
            "delay",
            "0",
            "1000000",
            "5",
            "",
        ])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&refused.stdout).starts_with("BODY_TOO_LARGE"),
        "{refused:?}"
    );

    // Rust reads it back.
    let info = store
        .get(&topic, &JobId::new("cli-1").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((info.state, info.due_at), (JobState::Scheduled, due_at));
    assert_eq!(info.body, b"made by redis-cli");

    // Rust reserves it, redis-cli releases it with the token.
    let batch = store
        .reserve(&topic, Duration::from_secs(30), 10)
        .await
        .unwrap();
    let job = &batch.jobs[0];
    assert_eq!((job.id.as_str(), job.attempt), ("cli-1", 1));
    let token = job.token.to_string();
    assert_eq!(
        eval("release", &keys, &["cli-1", "999999"]),
        ["0"],
        "stale token"
    );
    assert_eq!(eval("release", &keys, &["cli-1", &token]), ["1"]);
    assert_eq!(
        store
            .get(&topic, &JobId::new("cli-1").unwrap())
            .await
            .unwrap(),
        None
    );

    // stats and get from redis-cli agree with Rust.
    let stats = eval("stats", &keys, &[]);
    assert_eq!(&stats[1..], ["0", "0", "0", "0", "0"]);
    assert_eq!(store.stats(&topic).await.unwrap().records, 0);
}

#[tokio::test]
async fn rust_puts_and_redis_cli_reserves_and_releases() {
    let store = common::test_store().await;
    let topic = Topic::new("polyglot.back").unwrap();
    let keys = store.keys().topic(&topic).0;
    let outcome = store
        .put(PutRequest {
            topic: topic.clone(),
            id: JobId::new("rust-1").unwrap(),
            body: b"made by rust".to_vec(),
            meta: b"m1".to_vec(),
            due: Due::NOW,
            mode: PutMode::Keep,
        })
        .await
        .unwrap();

    let got = eval("get", &keys, &["rust-1"]);
    assert_eq!(got[0], "scheduled");
    assert_eq!(got[1], outcome.due_at.to_string());

    // reserve: { now, next_due, { { id, due_at, attempt, token, meta, body } }, { } },
    // flattened one element per line by redis-cli.
    let reply = eval("reserve", &keys, &["30000", "10"]);
    assert_eq!(reply[1], "-1", "nothing else is waiting: {reply:?}");
    assert_eq!(
        &reply[2..5],
        [
            "rust-1".to_string(),
            outcome.due_at.to_string(),
            "1".to_string()
        ]
    );
    let token: u64 = reply[5].parse().unwrap();
    assert_eq!(&reply[6..8], ["m1", "made by rust"]);

    let info = store
        .get(&topic, &JobId::new("rust-1").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((info.state, info.token), (JobState::Reserved, token));

    // A Rust release with the token redis-cli got works too; first redis-cli retries.
    assert_eq!(
        eval("retry", &keys, &["rust-1", &token.to_string(), "0"]),
        ["1"]
    );
    let again = eval("reserve", &keys, &["30000", "10"]);
    assert_eq!(again[4], "2", "second attempt: {again:?}");
    let token2: u64 = again[5].parse().unwrap();
    let lease = |token| Lease {
        topic: topic.clone(),
        id: "rust-1".into(),
        token,
    };
    assert_eq!(store.release(&[lease(token)]).await.unwrap(), 0, "stale");
    assert_eq!(store.release(&[lease(token2)]).await.unwrap(), 1);
    assert_eq!(eval("get", &keys, &["rust-1"]), [""], "nil reply");
}

#[tokio::test]
async fn evalsha_after_script_load_works_from_any_client() {
    let store = common::test_store().await;
    let topic = Topic::new("polyglot.sha").unwrap();
    let keys = store.keys().topic(&topic).0;
    let source = std::fs::read_to_string(lua("put")).unwrap();
    let sha = redis_cli(&["SCRIPT", "LOAD", &source]).remove(0);
    assert_eq!(sha.len(), 40);
    let mut argv: Vec<&str> = vec!["EVALSHA", &sha, "4"];
    argv.extend(keys.iter().map(String::as_str));
    argv.extend_from_slice(&[
        "sha-1", "body", "", "replace", "at", "0", "1000000", "1000", "",
    ]);
    let reply = redis_cli(&argv);
    assert_eq!(reply[0], "scheduled");
    let listed = store.list(&topic, 10, 0).await.unwrap();
    assert_eq!(
        listed,
        vec![("sha-1".to_string(), reply[1].parse::<i64>().unwrap())]
    );
    assert_eq!(store.pull(&topic, 10).await.unwrap().jobs[0].body, b"body");
}

/// Puts `id` due now, reserves it and records a failure with `max_attempts` 1: parked,
/// its last failure at the server's now.
async fn park(store: &redisched::store::Store, topic: &Topic, id: &str) {
    store
        .put(PutRequest {
            topic: topic.clone(),
            id: JobId::new(id).unwrap(),
            body: b"x".to_vec(),
            meta: Vec::new(),
            due: Due::NOW,
            mode: PutMode::Keep,
        })
        .await
        .unwrap();
    let batch = store
        .reserve(topic, Duration::from_secs(30), 10)
        .await
        .unwrap();
    assert_eq!(batch.jobs.len(), 1, "only {id} is due");
    let lease = Lease {
        topic: topic.clone(),
        id: id.to_string(),
        token: batch.jobs[0].token,
    };
    let parked = store
        .retry_failed(&lease, Duration::ZERO, "http 500", 1)
        .await
        .unwrap();
    assert_eq!(parked, redisched::store::RetryOutcome::Parked);
}

#[tokio::test]
async fn redis_cli_redrives_a_failure_window_of_jobs_the_rust_store_parked() {
    let store = common::test_store().await;
    let topic = Topic::new("polyglot.window").unwrap();
    park(&store, &topic, "before").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let since = store.server_time().await.unwrap();
    park(&store, &topic, "inside").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let until = store.server_time().await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    park(&store, &topic, "after").await;

    // All eight keys, as lua/README.md lists them, from redis-cli.
    let keys = common::topic_keys(&store.prefix, topic.as_str(), common::FULL_KEY_NAMES);
    let path = lua("redrive_window");
    let (since, until) = (since.to_string(), until.to_string());
    let mut argv: Vec<&str> = vec!["--eval", &path];
    argv.extend(keys.iter().map(String::as_str));
    argv.extend([",", &since, &until, "", "100"]);
    assert_eq!(redis_cli(&argv), ["1", "1", ""], "moved, scanned, cursor");

    let state = |id: &'static str| {
        let store = store.store.clone();
        let topic = topic.clone();
        async move {
            let id = JobId::new(id).unwrap();
            store.get(&topic, &id).await.unwrap().unwrap().state
        }
    };
    assert_eq!(state("inside").await, JobState::Scheduled);
    assert_eq!(state("before").await, JobState::Parked);
    assert_eq!(state("after").await, JobState::Parked);
    // Rust's walk over everything takes the other two; the history has all three.
    let window = redisched::job::window::FailureWindow {
        since: 0,
        until: store.server_time().await.unwrap(),
    };
    assert_eq!(store.redrive_window(&topic, window).await.unwrap(), 2);
    let redriven = store
        .history(&topic, None, 10)
        .await
        .unwrap()
        .into_iter()
        .filter(|h| h.outcome == redisched::store::Outcome::Redriven)
        .count();
    assert_eq!(redriven, 3);
}

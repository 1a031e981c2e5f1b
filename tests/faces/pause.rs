//! Pause and resume of a topic, end to end with a real bridge, through each way an operator
//! has: the store (as the scripts' own clients call it), the CLI and the REST API. Each pauses
//! one topic while another flows, then resumes it and sees the backlog delivered. The script
//! level (`lua/pause.lua`, `lua/resume.lua`, a multi-topic reserve skipping a paused topic) is
//! tested beside the other scripts, in the `lua` binary.

use crate::common;

use std::time::Duration;

use common::bridge::{self, now_ms, test_config, Broker, InProcess};
use redisched::config::HttpConfig;
use redisched::job::Topic;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::features_cli::Cli;
use crate::features_http::Server;

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_topic_waits_while_another_flows_and_resume_delivers_the_backlog() {
    let mut config = test_config("pause");
    // Only the resume notification can make the backlog prompt.
    config.dispatch.poll_interval_ms = 30_000;
    let broker = Broker::new(&config).await;
    let mut held = broker.consume_ready("held").await;
    let mut flowing = broker.consume_ready("flowing").await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;
    let topic = Topic::new("held").unwrap();
    assert!(
        store.pause(&topic).await.expect("pause"),
        "paused before any job"
    );

    for i in 0..5 {
        broker.put("held", &format!("h-{i}"), b"h", &[]).await;
        broker.put("flowing", &format!("f-{i}"), b"f", &[]).await;
    }
    let other = flowing.collect(5, 10 * SECOND).await;
    assert_eq!(other.len(), 5, "the other topic flows");
    assert!(
        held.drain(2 * SECOND).await.is_empty(),
        "nothing of a paused topic"
    );
    let stats = store.stats(&topic).await.expect("stats");
    assert_eq!(stats.scheduled, 5, "commands still applied: {stats:?}");
    assert!(stats.paused);

    let resumed = now_ms();
    assert!(store.resume(&topic).await.expect("resume"));
    let backlog = held.collect(5, 10 * SECOND).await;
    assert_eq!(backlog.len(), 5, "the backlog is delivered");
    let last = backlog.iter().map(|(at, _)| *at).max().unwrap_or(resumed);
    assert!(
        last - resumed < 3_000,
        "resume was prompt: {} ms",
        last - resumed
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn pause_and_resume_through_the_cli_while_another_topic_flows() {
    let config = test_config("fpause");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let cli = Cli::on(&config.redis.prefix);
    // Pausing a topic that has no jobs yet works.
    let paused = cli.json(&["pause", "held"]).await;
    assert_eq!(paused["paused"], true);
    assert_eq!(paused["changed"], true);
    assert!(cli
        .ok(&["pause", "held"])
        .await
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
    let stats = cli.json(&["stats", "held"]).await;
    let row = &stats["topics"][0];
    assert_eq!(row["paused"], true, "{stats}");
    assert_eq!(row["scheduled"], 3, "{stats}");
    assert_eq!(row["due_now"], 3, "{stats}");
    let human = cli.ok(&["stats"]).await;
    let held = human.lines().find(|l| l.starts_with("held")).unwrap();
    assert!(held.trim_end().ends_with("yes"), "{human}");
    assert!(human.lines().next().unwrap().contains("PAUSED"), "{human}");

    let resumed = cli.json(&["resume", "held"]).await;
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
    assert!(cli.ok(&["resume", "held"]).await.contains("was not paused"));
    assert_eq!(
        cli.json(&["stats", "held"]).await["topics"][0]["paused"],
        false
    );

    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn pause_and_resume_over_rest_while_another_topic_flows() {
    let config = test_config("fhpause");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let s = Server::start(&config.redis.prefix, HttpConfig::default()).await;
    let bridge = InProcess::start(&config);

    let (status, body) = s.post("/v1/topics/held/pause").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({"topic": "held", "paused": true, "changed": true})
    );
    let (_, again) = s.post("/v1/topics/held/pause").await;
    assert_eq!(again["changed"], false);

    for n in 0..3 {
        broker.put("held", &format!("h{n}"), b"held", &[]).await;
        broker
            .put("flowing", &format!("f{n}"), b"flowing", &[])
            .await;
    }
    let got = ready.collect(3, Duration::from_secs(15)).await;
    let ids: Vec<String> = got.iter().map(|(_, d)| bridge::message_id(d)).collect();
    assert_eq!(ids.len(), 3, "the other topic flows: {ids:?}");
    assert!(ids.iter().all(|id| id.starts_with('f')), "{ids:?}");
    assert!(
        ready.drain(Duration::from_millis(1500)).await.is_empty(),
        "nothing of the paused topic is dispatched"
    );

    let (_, topics) = s.get("/v1/topics").await;
    let held = topics["topics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["topic"] == "held")
        .unwrap_or_else(|| panic!("{topics}"));
    assert_eq!(
        (&held["paused"], &held["scheduled"]),
        (&json!(true), &json!(3)),
        "{held}"
    );
    let flowing = topics["topics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["topic"] == "flowing")
        .unwrap();
    assert_eq!(flowing["paused"], false);
    let text = s.metrics().await;
    assert!(
        text.contains("redisched_topic_paused{topic=\"held\"} 1\n"),
        "{text}"
    );

    let (status, body) = s.post("/v1/topics/held/resume").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({"topic": "held", "paused": false, "changed": true})
    );
    let got = ready.collect(3, Duration::from_secs(15)).await;
    let mut ids: Vec<String> = got.iter().map(|(_, d)| bridge::message_id(d)).collect();
    ids.sort();
    assert_eq!(
        ids,
        ["h0", "h1", "h2"],
        "the backlog is dispatched on resume"
    );
    let (_, again) = s.post("/v1/topics/held/resume").await;
    assert_eq!(again["changed"], false);
    let text = s.metrics().await;
    assert!(
        !text.contains("redisched_topic_paused{topic=\"held\"} 1"),
        "{text}"
    );
    // A bad topic is the client's error.
    let (status, _) = s.post("/v1/topics/a%20b/pause").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    bridge.stop().await;
    drop(s);
    broker.cleanup().await;
}

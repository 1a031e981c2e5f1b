//! Target health end to end (the book's *Webhook targets*, "Target health"): a real
//! bridge (or three) on the real Redis and RabbitMQ against receivers the test runs. A
//! dead target's breaker opens within `min_requests`, probes at most once per `open_ms`
//! across every bridge, its jobs spend no attempts while it is open and are all
//! delivered once it recovers; a 410 from the target's URL disables it (event on
//! `redisched.events`, metric, API) until `POST /v1/targets/{name}/enable`. Meanwhile
//! `GET /v1/topics` shows the topic `held_by` the target, and `null` again once it is
//! closed.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::faults::free_port;
use common::receiver::{Answer, Receiver};
use redisched::config::Config;
use redisched::job::{JobId, Topic};
use redisched::store::{HealthOp, Store};
use redisched::targets::health::State;
use redisched::targets::{BreakerConfig, TargetConfig};

const SECOND: Duration = Duration::from_secs(1);
const OPEN_MS: u64 = 1_000;

fn config(label: &str, url: String) -> Config {
    let mut config = test_config(label);
    config.targets = vec![TargetConfig {
        name: "ledger".into(),
        topics: vec!["ledger".into()],
        url,
        timeout_ms: 2_000,
        max_in_flight: 1,
        breaker: BreakerConfig {
            failure_ratio: 0.5,
            window_ms: 60_000,
            min_requests: 3,
            open_ms: OPEN_MS,
            disable_after_trips: 100,
        },
        ..TargetConfig::default()
    }];
    config.dispatch.max_attempts = 100;
    config.dispatch.retry_min_ms = 50;
    config.dispatch.retry_max_ms = 100;
    config.validate().expect("valid test config");
    config
}

async fn state(store: &Store, config: &Config) -> State {
    let t = &config.targets[0];
    let h = store
        .target_health(&t.name, &t.breaker, HealthOp::Get)
        .await;
    h.expect("target_health get").state
}

async fn wait_state(store: &Store, config: &Config, want: State) {
    let deadline = Instant::now() + 15 * SECOND;
    while state(store, config).await != want {
        assert!(Instant::now() < deadline, "never {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn attempts(store: &Store, ids: &[String]) -> u32 {
    let topic = Topic::new("ledger").unwrap();
    let mut sum = 0;
    for id in ids {
        let job = store.get(&topic, &JobId::new(id.as_str()).unwrap()).await;
        sum += job.expect("get").map_or(0, |j| j.attempts);
    }
    sum
}

async fn all_released(store: &Store, ids: &[String]) {
    let topic = Topic::new("ledger").unwrap();
    let deadline = Instant::now() + 20 * SECOND;
    for id in ids {
        let id = JobId::new(id.as_str()).unwrap();
        while store.get(&topic, &id).await.expect("get").is_some() {
            assert!(Instant::now() < deadline, "{id:?} never delivered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The receiver's requests after `since`, by job id.
fn by_id(receiver: &Receiver, since: Instant) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in receiver.received().into_iter().filter(|r| r.at >= since) {
        *counts
            .entry(r.header("x-redisched-id").unwrap_or_default())
            .or_insert(0) += 1;
    }
    counts
}

/// Checks a dead target with `bridges` bridges on one Redis: opens within
/// `min_requests` (+ the requests in flight), probes at most once per `open_ms`,
/// spends no attempts while open, delivers every job once it recovers.
async fn dead_target(label: &str, bridges: usize) {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.set_default(Answer::status(500).body("down"));
    let config = config(label, receiver.url("/hook"));
    let broker = Broker::new(&config).await;
    // The first bridge serves the API (one port: the others serve none).
    let mut first = config.clone();
    let port = free_port();
    first.http.enabled = true;
    first.http.listen = format!("127.0.0.1:{port}");
    let base = format!("http://127.0.0.1:{port}");
    let running: Vec<_> = (0..bridges)
        .map(|i| InProcess::start(if i == 0 { &first } else { &config }))
        .collect();
    wait_for_api(&base).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let ids: Vec<String> = (0..6).map(|i| format!("j{i}")).collect();
    for id in &ids {
        broker.put("ledger", id, b"x", &[]).await;
    }
    wait_state(&store, &config, State::Open).await;
    let at_open = receiver.received().len();
    // Shown per topic; still failing, so open or (probing) half_open, never closed.
    let held = held_by(&base, "ledger").await;
    assert_eq!(held["target"], "ledger", "{held}");
    assert!(
        held["state"] == "open" || held["state"] == "half_open",
        "{held}"
    );
    assert!(held["state_reason"].is_string(), "{held}");
    assert!(
        at_open <= 3 + bridges,
        "opened within min_requests (3) and the requests in flight ({bridges}): {at_open}"
    );
    // While it stays down: at most one probe per open_ms, attempts spent only by them.
    let spent = attempts(&store, &ids).await;
    let watch = Duration::from_millis(3_500);
    tokio::time::sleep(watch).await;
    let probes = receiver.received().len() - at_open;
    let most = (watch.as_millis() as u64).div_ceil(OPEN_MS) as usize;
    assert!(
        probes <= most,
        "{probes} requests in {watch:?} while open (at most one probe per {OPEN_MS} ms: {most})"
    );
    assert!(probes >= 1, "half-open sends a probe");
    let spent_open = attempts(&store, &ids).await - spent;
    assert!(
        spent_open as usize <= probes,
        "only the probes spend attempts: {spent_open} spent, {probes} probes"
    );
    // It recovers: the next probe closes it and every job is delivered, once.
    let recovered = Instant::now();
    receiver.set_default(Answer::status(204));
    all_released(&store, &ids).await;
    assert_eq!(state(&store, &config).await, State::Closed);
    assert!(
        held_by(&base, "ledger").await.is_null(),
        "closed: held by nothing"
    );
    let counts = by_id(&receiver, recovered);
    for id in &ids {
        assert_eq!(counts.get(id), Some(&1), "{id} delivered once: {counts:?}");
    }
    for bridge in running {
        bridge.stop().await;
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_target_opens_its_breaker_probes_once_per_open_ms_and_delivers_all_once_back() {
    dead_target("breaker1", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_bridges_share_one_breaker_and_one_probe_per_open_ms() {
    dead_target("breaker3", 3).await;
}

async fn wait_for_api(base: &str) {
    let deadline = Instant::now() + 15 * SECOND;
    while reqwest::get(format!("{base}/healthz")).await.is_err() {
        assert!(Instant::now() < deadline, "the API never came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The next event of target `name` (other tests share the exchange).
async fn next_event(
    events: &mut common::bridge::Receiver,
    name: &str,
) -> (String, serde_json::Value) {
    let deadline = Instant::now() + 10 * SECOND;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let (_, event) = events.next(left).await.expect("an event");
        let body: serde_json::Value = serde_json::from_slice(&event.data).expect("JSON");
        if body["target"] == name {
            return (event.routing_key.to_string(), body);
        }
    }
}

/// `held_by` of `topic`'s row of `GET /v1/topics` (present, `null` or an object).
async fn held_by(base: &str, topic: &str) -> serde_json::Value {
    let reply = reqwest::get(format!("{base}/v1/topics"))
        .await
        .expect("GET");
    assert!(reply.status().is_success());
    let json: serde_json::Value = reply.json().await.expect("json");
    let rows = json["topics"].as_array().cloned().unwrap_or_default();
    let row = rows
        .iter()
        .find(|r| r["topic"] == topic)
        .unwrap_or_else(|| panic!("no row of {topic}: {json}"));
    row.get("held_by")
        .cloned()
        .unwrap_or_else(|| panic!("no held_by: {row}"))
}

async fn targets_json(base: &str) -> serde_json::Value {
    let reply = reqwest::get(format!("{base}/v1/targets"))
        .await
        .expect("GET");
    assert!(reply.status().is_success());
    let json: serde_json::Value = reply.json().await.expect("json");
    json["targets"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_disables_the_target_until_enabled_then_every_held_job_goes_once() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.set_default(Answer::status(410).body("gone for good"));
    let mut config = config("gone410", receiver.url("/hook"));
    let name = common::unique("ledger");
    config.targets[0].name = name.clone();
    let port = free_port();
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{port}");
    let base = format!("http://127.0.0.1:{port}");
    let broker = Broker::new(&config).await;
    // Declared as the bridge declares it (durable topic), so the test can bind first.
    broker
        .channel
        .exchange_declare(
            redisched::events::EXCHANGE.into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("declare redisched.events");
    let mut events = broker
        .consume_exchange(redisched::events::EXCHANGE, "target.#")
        .await;
    let bridge = InProcess::start(&config);
    wait_for_api(&base).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let ids: Vec<String> = (0..5).map(|i| format!("g{i}")).collect();
    for id in &ids {
        broker.put("ledger", id, b"x", &[]).await;
    }
    wait_state(&store, &config, State::Disabled).await;

    // The event, once, by the bridge that made the change.
    let (key, body) = next_event(&mut events, &name).await;
    assert_eq!(key, "target.disabled");
    assert_eq!(body["state"], "disabled");
    assert!(
        body["reason"].as_str().unwrap_or("").contains("410"),
        "{body}"
    );
    let at = body["at"].as_str().expect("at");
    assert!(humantime::parse_rfc3339(at).is_ok(), "RFC 3339: {at}");
    // Metric, API, the dashboard's data.
    let deadline = Instant::now() + 5 * SECOND;
    loop {
        let text = reqwest::get(format!("{base}/metrics"))
            .await
            .expect("metrics");
        let text = text.text().await.expect("text");
        let state =
            format!(r#"redisched_webhook_target_state{{target="{name}",state="disabled"}} 1"#);
        let moved = format!(
            r#"redisched_webhook_target_transitions_total{{target="{name}",to="disabled"}} 1"#
        );
        if text.contains(&state) && text.contains(&moved) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "metrics never showed it:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let row = targets_json(&base).await;
    assert_eq!(row["state"], "disabled");
    assert_eq!(row["held_by_breaker"], true);
    let held = held_by(&base, "ledger").await;
    assert_eq!(
        held,
        serde_json::json!({"target": name, "state": "disabled", "state_reason": row["state_reason"]}),
        "the topic's view of the target's state"
    );
    assert!(
        held["state_reason"].as_str().unwrap_or("").contains("410"),
        "{held}"
    );
    let dashboard = reqwest::get(format!("{base}/")).await.expect("dashboard");
    let html = dashboard.text().await.expect("html");
    assert!(
        html.contains("held by the breaker"),
        "the dashboard shows the state"
    );

    // Nothing is sent while disabled; nothing is lost.
    let sent = receiver.received().len();
    assert_eq!(sent, 1, "the 410 alone reached the receiver");
    tokio::time::sleep(2 * SECOND).await;
    assert_eq!(
        receiver.received().len(),
        sent,
        "nothing sent while disabled"
    );
    assert_eq!(
        attempts(&store, &ids).await,
        1,
        "only the job that got the 410 spent an attempt; the held ones none"
    );

    receiver.set_default(Answer::status(204));
    let enabled = Instant::now();
    let reply = reqwest::Client::new()
        .post(format!("{base}/v1/targets/{name}/enable"))
        .send()
        .await
        .expect("enable");
    assert!(reply.status().is_success(), "{}", reply.status());
    let (key, _) = next_event(&mut events, &name).await;
    assert_eq!(key, "target.enabled");
    all_released(&store, &ids).await;
    let counts = by_id(&receiver, enabled);
    for id in &ids {
        assert_eq!(counts.get(id), Some(&1), "{id} delivered once: {counts:?}");
    }
    assert_eq!(targets_json(&base).await["state"], "closed");
    assert!(
        held_by(&base, "ledger").await.is_null(),
        "enabled: held by nothing"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

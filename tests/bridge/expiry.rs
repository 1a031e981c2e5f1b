//! Job expiry against a real bridge on the real Redis and RabbitMQ (README "Expiry"): a
//! job not delivered by its due time + expires-after is not delivered but set aside to
//! the expired exchange, confirmed, then released with history outcome `expired`.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::receiver::{Answer, Receiver};
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use redisched::config::{Config, PolicyConfig};
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{Outcome, PutRequest, Store};
use redisched::targets::TargetConfig;

const SECOND: Duration = Duration::from_secs(1);
const EXPIRES: &str = "x-redisched-expires-after";

fn t(name: &str) -> Topic {
    Topic::new(name).unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls until `get` finds no job `id` (it was released), 15 s at most.
async fn gone(store: &Store, topic: &str, id: &str) {
    let (topic, id) = (t(topic), JobId::new(id).unwrap());
    let deadline = Instant::now() + 15 * SECOND;
    while store.get(&topic, &id).await.expect("get").is_some() {
        assert!(Instant::now() < deadline, "job {id} was never released");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls until the job is stored (its command was applied), 15 s at most.
async fn stored(store: &Store, topic: &str, id: &str) {
    let (topic, id) = (t(topic), JobId::new(id).unwrap());
    let deadline = Instant::now() + 15 * SECOND;
    while store.get(&topic, &id).await.expect("get").is_none() {
        assert!(Instant::now() < deadline, "job {id} was never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The outcomes of job `id`, newest first, with their detail.
async fn outcomes(store: &Store, topic: &str, id: &str) -> Vec<(Outcome, String)> {
    store
        .history(&t(topic), Some(&JobId::new(id).unwrap()), 20)
        .await
        .expect("history")
        .into_iter()
        .map(|e| (e.outcome, e.detail))
        .collect()
}

/// Puts a job straight into the store (as REST and the CLI do) with its own expiry.
async fn put_with_expiry(store: &Store, topic: &str, id: &str, body: &[u8], ms: Option<u64>) {
    store
        .put(PutRequest {
            topic: t(topic),
            id: JobId::new(id).unwrap(),
            body: body.to_vec(),
            meta: redisched::job::expiry::meta_with_expiry(Vec::new(), ms),
            due: Due::NOW,
            mode: PutMode::Keep,
        })
        .await
        .expect("put");
}

fn reason(ms: u64) -> String {
    format!("expired: not delivered within {ms} ms after its due time")
}

fn assert_set_aside(copy: &Delivery, topic: &str, id: &str, ms: u64) {
    assert_eq!(message_id(copy), id);
    assert_eq!(copy.routing_key.as_str(), topic);
    assert_eq!(
        header_text(copy, "x-redisched-error").as_deref(),
        Some(reason(ms).as_str())
    );
    assert_eq!(
        header_text(copy, "x-redisched-topic").as_deref(),
        Some(topic)
    );
}

async fn metrics_text(base: &str) -> String {
    reqwest::get(format!("{base}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

async fn wait_for_api(base: &str) {
    let deadline = Instant::now() + 15 * SECOND;
    while reqwest::get(format!("{base}/healthz")).await.is_err() {
        assert!(Instant::now() < deadline, "the API never came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_bridge_was_down_past_its_expiry_is_set_aside_not_delivered() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("expdown");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut expired = broker.consume_queue(&config.amqp.expired_queue).await;
    let store = common::test_store_named(&config.redis.prefix).await;

    let mut bridge = ChildBridge::start(&config);
    // Both due in 1.5 s: one may be 400 ms late, the other a minute.
    let due = now_ms() + 1_500;
    let short = props(
        "late-1",
        &[
            ("x-deliver-at", AMQPValue::LongLongInt(due)),
            (EXPIRES, AMQPValue::LongInt(400)),
            ("x-tenant", text("acme")),
        ],
    )
    .with_content_type("application/json".into())
    .with_correlation_id("corr-7".into());
    broker
        .command("mail.remind", short, br#"{"user":42}"#)
        .await;
    let long = props(
        "late-2",
        &[
            ("x-deliver-at", AMQPValue::LongLongInt(due)),
            (EXPIRES, text("60000")),
        ],
    );
    broker.command("mail.remind", long, b"still fine").await;
    stored(&store, "mail.remind", "late-1").await;
    stored(&store, "mail.remind", "late-2").await;
    let (status, _) = bridge.terminate();
    assert!(status.success(), "{status}");

    // The bridge stays down past due + 400 ms.
    let wait = (due + 400 + 600 - now_ms()).max(0) as u64;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let port = free_port();
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{port}");
    let mut bridge = ChildBridge::start(&config);
    let base = format!("http://127.0.0.1:{port}");

    let (_, copy) = expired.next(15 * SECOND).await.expect("set aside");
    assert_set_aside(&copy, "mail.remind", "late-1", 400);
    assert_eq!(copy.data, br#"{"user":42}"#, "body intact");
    assert_eq!(
        copy.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(
        copy.properties
            .correlation_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("corr-7")
    );
    assert_eq!(header_text(&copy, "x-tenant").as_deref(), Some("acme"));
    assert_eq!(header_i64(&copy, "x-redisched-due-at"), Some(due));
    assert_eq!(
        header(&copy, EXPIRES),
        Some(&AMQPValue::LongInt(400)),
        "the job's own header travels with it"
    );

    // The other one, well within its minute, is delivered; the expired one never is.
    let (_, delivered) = ready.next(15 * SECOND).await.expect("delivered");
    assert_eq!(message_id(&delivered), "late-2");
    assert_eq!(delivered.data, b"still fine");
    gone(&store, "mail.remind", "late-1").await;
    gone(&store, "mail.remind", "late-2").await;
    let more = ready.drain(SECOND).await;
    assert!(
        more.is_empty(),
        "nothing else delivered: {:?}",
        id_counts(&more)
    );
    assert!(expired.drain(Duration::from_millis(300)).await.is_empty());

    let history = outcomes(&store, "mail.remind", "late-1").await;
    assert_eq!(history[0].0, Outcome::Expired, "{history:?}");
    assert!(history[0].1.contains("within 400 ms"), "{history:?}");
    let history = outcomes(&store, "mail.remind", "late-2").await;
    assert_eq!(history[0].0, Outcome::Dispatched, "{history:?}");

    wait_for_api(&base).await;
    let metrics = metrics_text(&base).await;
    assert!(
        metrics.contains("redisched_jobs_expired_total{topic=\"mail.remind\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("redisched_jobs_dispatched_total 1\n"),
        "{metrics}"
    );
    let (status, _) = bridge.terminate();
    assert!(status.success(), "{status}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_topic_resumed_after_expiry_sets_its_expired_jobs_aside() {
    let _shared = common::timed::shared().await;
    let config = test_config("exppause");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut expired = broker.consume_queue(&config.amqp.expired_queue).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let bridge = InProcess::start(&config);

    store.pause(&t("held")).await.expect("pause");
    put_with_expiry(&store, "held", "p-1", b"too late", Some(300)).await;
    put_with_expiry(&store, "held", "p-2", b"no expiry", None).await;
    put_with_expiry(&store, "held", "p-3", b"a long one", Some(120_000)).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(
        ready.drain(Duration::from_millis(100)).await.is_empty(),
        "paused"
    );
    store.resume(&t("held")).await.expect("resume");

    let (_, copy) = expired.next(10 * SECOND).await.expect("set aside");
    assert_set_aside(&copy, "held", "p-1", 300);
    assert_eq!(copy.data, b"too late");
    let got = ready.collect(2, 10 * SECOND).await;
    let mut ids: Vec<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    ids.sort();
    assert_eq!(ids, ["p-2", "p-3"]);
    for id in ["p-1", "p-2", "p-3"] {
        gone(&store, "held", id).await;
    }
    assert_eq!(outcomes(&store, "held", "p-1").await[0].0, Outcome::Expired);
    assert!(expired.drain(Duration::from_millis(300)).await.is_empty());
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_series_occurrence_is_set_aside_and_the_next_one_delivered() {
    let _shared = common::timed::shared().await;
    let config = test_config("expseries");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut expired = broker.consume_queue(&config.amqp.expired_queue).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let bridge = InProcess::start(&config);

    let series = props(
        "tick",
        &[
            ("x-redisched-every", AMQPValue::LongInt(1_000)),
            (EXPIRES, AMQPValue::LongInt(250)),
        ],
    );
    broker.command("clock", series, b"tick").await;
    let (_, first) = ready.next(10 * SECOND).await.expect("first occurrence");
    let first_due = header_i64(&first, "x-redisched-due-at").expect("due");

    // Paused over two occurrences: the one that fell due meanwhile is older than 250 ms
    // at the resume, so it is set aside; the series goes on.
    store.pause(&t("clock")).await.expect("pause");
    tokio::time::sleep(Duration::from_millis(2_300)).await;
    store.resume(&t("clock")).await.expect("resume");
    let resumed = now_ms();

    let (_, copy) = expired.next(10 * SECOND).await.expect("set aside");
    assert_set_aside(&copy, "clock", "tick", 250);
    let skipped_due = header_i64(&copy, "x-redisched-due-at").expect("due");
    assert!(
        skipped_due > first_due && skipped_due + 250 < resumed,
        "{first_due} {skipped_due} {resumed}"
    );
    assert_eq!((skipped_due - first_due) % 1_000, 0, "on the grid");

    let (at, next) = ready.next(10 * SECOND).await.expect("next occurrence");
    let next_due = header_i64(&next, "x-redisched-due-at").expect("due");
    assert!(next_due > skipped_due, "{next_due} after {skipped_due}");
    assert!(at >= next_due, "never early");
    assert_eq!((next_due - first_due) % 1_000, 0, "on the grid");
    let history = outcomes(&store, "clock", "tick").await;
    let expired_entry = history
        .iter()
        .find(|(o, _)| *o == Outcome::Expired)
        .expect("an expired entry");
    assert!(
        expired_entry.1.starts_with(&next_due.to_string()),
        "the detail names the next occurrence: {history:?}"
    );
    // Still one series, scheduled.
    assert!(store
        .get(&t("clock"), &JobId::new("tick").unwrap())
        .await
        .unwrap()
        .is_some());
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_gives_the_default_and_a_jobs_own_header_overrides_it() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("exppolicy");
    config.policies = vec![PolicyConfig {
        topics: vec!["bulk.#".into()],
        expires_after_ms: Some(300),
        ..PolicyConfig::default()
    }];
    config.validate().expect("valid");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut expired = broker.consume_queue(&config.amqp.expired_queue).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let bridge = InProcess::start(&config);

    for topic in ["bulk.news", "other"] {
        store.pause(&t(topic)).await.expect("pause");
    }
    put_with_expiry(&store, "bulk.news", "d-1", b"policy", None).await;
    put_with_expiry(&store, "bulk.news", "d-2", b"never", Some(0)).await;
    put_with_expiry(&store, "other", "d-3", b"no policy", None).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    for topic in ["bulk.news", "other"] {
        store.resume(&t(topic)).await.expect("resume");
    }

    let (_, copy) = expired.next(10 * SECOND).await.expect("set aside");
    assert_set_aside(&copy, "bulk.news", "d-1", 300);
    let got = ready.collect(2, 10 * SECOND).await;
    let mut ids: Vec<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    ids.sort();
    assert_eq!(ids, ["d-2", "d-3"], "0 = never; no policy = never");
    assert!(expired.drain(Duration::from_millis(500)).await.is_empty());
    bridge.stop().await;
    broker.cleanup().await;
}

fn target(name: &str, topics: &[&str], url: String) -> TargetConfig {
    TargetConfig {
        name: name.into(),
        topics: topics.iter().map(|s| s.to_string()).collect(),
        url,
        timeout_ms: 2_000,
        ..TargetConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_job_whose_target_fails_until_its_expiry_is_set_aside() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.set_default(Answer::status(503));
    let mut config: Config = test_config("exphook");
    config.targets = vec![target("billing", &["billing"], receiver.url("/r"))];
    config.validate().expect("valid");
    let broker = Broker::new(&config).await;
    let mut expired = broker.consume_queue(&config.amqp.expired_queue).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let bridge = InProcess::start(&config);

    let started = now_ms();
    put_with_expiry(&store, "billing", "inv-9", b"{\"amount\":1}", Some(1_500)).await;
    let (at, copy) = expired.next(15 * SECOND).await.expect("set aside");
    assert_set_aside(&copy, "billing", "inv-9", 1_500);
    assert_eq!(copy.data, b"{\"amount\":1}");
    assert!(
        at >= started + 1_500,
        "not before its expiry: {}",
        at - started
    );
    let tries = receiver.received().len();
    assert!(tries >= 2, "POSTed and retried until then: {tries}");
    gone(&store, "billing", "inv-9").await;
    let history = outcomes(&store, "billing", "inv-9").await;
    assert_eq!(history[0].0, Outcome::Expired, "{history:?}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(receiver.received().len(), tries, "no POST after it expired");
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_expiry_values_are_refused_with_a_reason_and_lose_nothing() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("expbad");
    let port = free_port();
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{port}");
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let bridge = InProcess::start(&config);
    let base = format!("http://127.0.0.1:{port}");

    // AMQP: set aside with the reason, body and properties intact.
    for (id, value) in [
        ("neg", AMQPValue::LongInt(-5)),
        ("word", text("soon")),
        ("float", AMQPValue::Double(1.5)),
    ] {
        broker
            .command("bad", props(id, &[(EXPIRES, value)]), id.as_bytes())
            .await;
    }
    let got = invalid.collect(3, 10 * SECOND).await;
    assert_eq!(got.len(), 3);
    for (_, d) in &got {
        let why = header_text(d, "x-redisched-error").unwrap_or_default();
        assert!(why.contains(EXPIRES), "{why}");
        assert_eq!(d.data, message_id(d).as_bytes());
    }
    let neg = got.iter().find(|(_, d)| message_id(d) == "neg").unwrap();
    assert!(header_text(&neg.1, "x-redisched-error")
        .unwrap()
        .contains(">= 0"));

    // REST: 400 with the reason; a good value is stored and shown.
    wait_for_api(&base).await;
    let http = reqwest::Client::new();
    for bad in ["-1", "later", "2.5"] {
        let answer = http
            .put(format!("{base}/v1/topics/bad/jobs/rest-bad"))
            .query(&[("expires_after", bad), ("delay_ms", "60000")])
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 400, "{bad}");
        let text = answer.text().await.unwrap();
        assert!(text.contains("expires_after"), "{text}");
    }
    let answer = http
        .put(format!("{base}/v1/topics/bad/jobs/rest-ok"))
        .query(&[("expires_after", "5000"), ("delay_ms", "60000")])
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 201);
    let job: serde_json::Value = http
        .get(format!("{base}/v1/topics/bad/jobs/rest-ok"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(job["expires_after"], 5000, "{job}");
    for id in ["neg", "word", "float", "rest-bad"] {
        let job = store
            .get(&t("bad"), &JobId::new(id).unwrap())
            .await
            .unwrap();
        assert!(job.is_none(), "{id} refused, nothing stored");
    }

    // CLI: usage error (exit 2) naming the flag; a good value is stored.
    let cli = |args: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_redisched"));
        for (key, _) in std::env::vars() {
            if key.starts_with("REDISCHED_") {
                cmd.env_remove(key);
            }
        }
        cmd.env("REDISCHED_REDIS__URL", &config.redis.url)
            .env("REDISCHED_REDIS__PREFIX", &config.redis.prefix)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run redisched")
    };
    for bad in ["-1", "soon"] {
        let out = cli(&[
            "put",
            "bad",
            "cli-bad",
            "x",
            "--delay",
            "1m",
            "--expires-after",
            bad,
        ]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--expires-after"), "{err}");
    }
    let out = cli(&[
        "put",
        "bad",
        "cli-ok",
        "x",
        "--delay",
        "1m",
        "--expires-after",
        "7000",
    ]);
    assert!(out.status.success(), "{out:?}");
    let out = cli(&["get", "bad", "cli-ok", "--json"]);
    let job: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(job["expires_after"], 7000, "{job}");
    assert!(store
        .get(&t("bad"), &JobId::new("cli-bad").unwrap())
        .await
        .unwrap()
        .is_none());
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test]
async fn release_with_the_expired_marker_logs_expired_and_keeps_a_series_going() {
    let _shared = common::timed::shared().await;
    use redisched::job::spec::ScheduleSpec;
    use redisched::store::{Delivered, Expired, NextDue, Noted};
    let test = common::test_store().await;
    let store = &test.store;
    let topic = t("marker");
    put_with_expiry(store, "marker", "one", b"x", Some(1)).await;
    store
        .put_recurring(
            PutRequest {
                topic: topic.clone(),
                id: JobId::new("series").unwrap(),
                body: b"s".to_vec(),
                meta: Vec::new(),
                due: Due::NOW,
                mode: PutMode::Keep,
            },
            ScheduleSpec::new("every:60000").unwrap(),
        )
        .await
        .expect("put series");
    let batch = store
        .reserve(&topic, Duration::from_secs(30), 10)
        .await
        .expect("reserve");
    assert_eq!(batch.jobs.len(), 2);
    let next = batch.now + 60_000;
    let expired: Vec<Expired> = batch
        .jobs
        .iter()
        .map(|job| {
            Expired(Noted {
                delivered: Delivered {
                    lease: redisched::store::Lease {
                        topic: topic.clone(),
                        id: job.id.clone(),
                        token: job.token,
                    },
                    next_due: if job.spec.is_some() {
                        NextDue::At(next)
                    } else {
                        NextDue::OneShot
                    },
                },
                note: "not delivered within 1 ms after its due time".into(),
            })
        })
        .collect();
    assert_eq!(store.release_expired(&expired).await.expect("release"), 2);
    // Released again (a stale lease): nothing changes.
    assert_eq!(store.release_expired(&expired).await.expect("release"), 0);

    assert!(store
        .get(&topic, &JobId::new("one").unwrap())
        .await
        .unwrap()
        .is_none());
    let series = store
        .get(&topic, &JobId::new("series").unwrap())
        .await
        .unwrap()
        .expect("the series goes on");
    assert_eq!(series.due_at, next);
    let one = outcomes(store, "marker", "one").await;
    assert_eq!(
        one,
        [(
            Outcome::Expired,
            "not delivered within 1 ms after its due time".to_owned()
        )]
    );
    let series = outcomes(store, "marker", "series").await;
    assert_eq!(
        series,
        [(
            Outcome::Expired,
            format!("{next} not delivered within 1 ms after its due time")
        )]
    );
}

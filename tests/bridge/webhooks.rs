//! Webhook targets against real HTTP receivers the test runs, with a real bridge on
//! the real Redis and RabbitMQ (README "Webhook targets").

use crate::common;

use std::time::{Duration, Instant};

use common::bridge::*;
use common::receiver::{Answer, Receiver};
use common::verifiers;
use lapin::types::AMQPValue;
use redisched::config::Config;
use redisched::job::{JobId, Topic};
use redisched::store::{JobInfo, JobState, Store};
use redisched::targets::TargetConfig;
use redisched_testkit::percentile;

const SECOND: Duration = Duration::from_secs(1);
const SECRET_A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SECRET_B: &str = "whsec_c2Vjb25kIHNlY3JldCBkdXJpbmcgcm90YXRpb24=";

fn target(name: &str, topics: &[&str], url: String) -> TargetConfig {
    TargetConfig {
        name: name.into(),
        topics: topics.iter().map(|s| s.to_string()).collect(),
        url,
        timeout_ms: 2_000,
        ..TargetConfig::default()
    }
}

fn config_with(label: &str, targets: Vec<TargetConfig>) -> Config {
    let mut config = test_config(label);
    config.targets = targets;
    config.validate().expect("valid test config");
    config
}

/// Polls `get` until `done` holds for the job (15 s at most).
async fn wait_for(
    store: &Store,
    topic: &str,
    id: &str,
    done: impl Fn(Option<&JobInfo>) -> bool,
) -> Option<JobInfo> {
    let (topic, id) = (Topic::new(topic).unwrap(), JobId::new(id).unwrap());
    let deadline = Instant::now() + 15 * SECOND;
    loop {
        let job = store.get(&topic, &id).await.expect("get");
        if done(job.as_ref()) {
            return job;
        }
        assert!(Instant::now() < deadline, "job never got there: {job:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn released(store: &Store, topic: &str, id: &str) {
    wait_for(store, topic, id, |job| job.is_none()).await;
}

fn props_with(
    id: &str,
    content_type: &str,
    headers: &[(&str, AMQPValue)],
) -> lapin::BasicProperties {
    props(id, headers).with_content_type(content_type.into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_job_is_posted_with_every_header_and_released() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let mut hook = target(
        "billing",
        &["billing", "billing.#"],
        receiver.url("/receive"),
    );
    hook.signing_secrets = vec![SECRET_A.into()];
    hook.forward_headers = true;
    hook.headers.insert("x-api-key".into(), "k-123".into());
    let config = config_with("hookok", vec![hook]);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    // Far enough ahead that the bridge has started (a past time would mean now).
    let due = now_ms() + 1_500;
    let props = props_with(
        "inv-1",
        "application/json",
        &[
            ("x-deliver-at", AMQPValue::LongLongInt(due)),
            ("x-tenant", text("acme")),
        ],
    );
    broker
        .command("billing.eu", props, br#"{"amount":42}"#)
        .await;
    let got = receiver.wait_for(1, 10 * SECOND).await;
    assert_eq!(got.len(), 1, "one request");
    let r = &got[0];
    assert!(r.epoch_ms >= due, "never early: {} < {due}", r.epoch_ms);
    assert_eq!(r.path, "/receive");
    assert_eq!(r.body, br#"{"amount":42}"#);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    assert_eq!(r.header("x-redisched-topic").as_deref(), Some("billing.eu"));
    assert_eq!(r.header("x-redisched-id").as_deref(), Some("inv-1"));
    assert_eq!(r.header("x-redisched-due-at"), Some(due.to_string()));
    assert_eq!(r.header("x-redisched-attempt").as_deref(), Some("1"));
    assert_eq!(
        r.header("x-redisched-header-x-tenant").as_deref(),
        Some("acme")
    );
    assert_eq!(r.header("x-api-key").as_deref(), Some("k-123"));
    assert!(r
        .header("webhook-id")
        .is_some_and(|id| id.starts_with("msg_")));
    let ts: i64 = r.header("webhook-timestamp").unwrap().parse().unwrap();
    assert!(
        (ts - r.epoch_ms / 1000).abs() <= 2,
        "timestamp is now: {ts}"
    );
    assert!(r
        .header("webhook-signature")
        .is_some_and(|s| s.starts_with("v1,")));

    released(&store, "billing.eu", "inv-1").await;
    let history = store
        .history(
            &Topic::new("billing.eu").unwrap(),
            Some(&JobId::new("inv-1").unwrap()),
            5,
        )
        .await
        .unwrap();
    assert_eq!(history.len(), 1, "{history:?}");
    assert_eq!(history[0].outcome, redisched::store::Outcome::Dispatched);
    assert_eq!(
        history[0].detail, "HTTP 200",
        "the status code is on record"
    );
    assert!(
        ready.drain(SECOND).await.is_empty(),
        "nothing went to the ready exchange"
    );
    assert_eq!(receiver.received().len(), 1, "delivered once");
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500_then_a_200_is_retried_with_the_same_webhook_id_and_the_error_on_record() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.script([Answer::status(500).body("boom"), Answer::status(200)]);
    let config = config_with(
        "hook500",
        vec![target("billing", &["billing"], receiver.url("/r"))],
    );
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    broker.put("billing", "j1", b"x", &[]).await;
    let failing = wait_for(&store, "billing", "j1", |j| {
        j.is_some_and(|j| j.failures >= 1)
    })
    .await;
    assert_eq!(
        failing.unwrap().last_error.map(|e| e.reason).as_deref(),
        Some("HTTP 500 Internal Server Error from billing: boom")
    );
    let got = receiver.wait_for(2, 10 * SECOND).await;
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].header("x-redisched-attempt").as_deref(), Some("1"));
    assert_eq!(got[1].header("x-redisched-attempt").as_deref(), Some("2"));
    assert_eq!(
        got[0].header("webhook-id"),
        got[1].header("webhook-id"),
        "one occurrence, one id"
    );
    released(&store, "billing", "j1").await;
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_is_not_retried_before_that_time() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.script([Answer::status(429).header("retry-after", "2")]);
    let mut config = config_with(
        "hook429",
        vec![target("billing", &["billing"], receiver.url("/r"))],
    );
    config.dispatch.retry_max_ms = 10_000;
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    broker.put("billing", "j1", b"x", &[]).await;
    let got = receiver.wait_for(2, 15 * SECOND).await;
    assert_eq!(got.len(), 2);
    let gap = got[1].at - got[0].at;
    assert!(
        gap >= 2 * SECOND,
        "retried after {gap:?}, before Retry-After"
    );
    assert!(gap < 4 * SECOND, "but not much later: {gap:?}");
    released(&store, "billing", "j1").await;
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_receiver_hits_timeout_ms_and_the_job_is_retried() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.script([Answer::status(200).delay(10 * SECOND)]);
    let mut hook = target("slow", &["slow"], receiver.url("/r"));
    hook.timeout_ms = 500;
    let config = config_with("hookhang", vec![hook]);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    broker.put("slow", "j1", b"x", &[]).await;
    let failing = wait_for(&store, "slow", "j1", |j| j.is_some_and(|j| j.failures >= 1)).await;
    let reason = failing.unwrap().last_error.unwrap().reason;
    assert!(reason.starts_with("request to slow"), "{reason}");
    assert!(reason.contains("timed out after 500 ms"), "{reason}");
    let got = receiver.wait_for(2, 10 * SECOND).await;
    assert_eq!(got.len(), 2);
    let gap = got[1].at - got[0].at;
    assert!(
        gap >= Duration::from_millis(500),
        "the timeout ran out first: {gap:?}"
    );
    released(&store, "slow", "j1").await;
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_wait_while_the_receiver_is_down_and_all_arrive_once_it_is_up() {
    let _shared = common::timed::shared().await;
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    // Its breaker opens while the receiver is down; a short open_ms lets the probe
    // find it up soon (target_health.rs checks the breaker itself).
    let mut hook = target("down", &["down"], format!("http://{addr}/r"));
    hook.breaker.open_ms = 500;
    let mut config = config_with("hookdown", vec![hook]);
    config.dispatch.max_attempts = 0;
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    for i in 0..20 {
        broker.put("down", &format!("j{i}"), b"x", &[]).await;
    }
    let failing = wait_for(&store, "down", "j0", |j| j.is_some_and(|j| j.failures >= 1)).await;
    let reason = failing.unwrap().last_error.unwrap().reason;
    assert!(
        reason.starts_with("request to down") && reason.contains("could not connect"),
        "{reason}"
    );
    tokio::time::sleep(SECOND).await;
    for i in 0..20 {
        let job = store
            .get(
                &Topic::new("down").unwrap(),
                &JobId::new(format!("j{i}")).unwrap(),
            )
            .await
            .unwrap();
        assert!(job.is_some(), "j{i} kept while the receiver is down");
    }
    let receiver = Receiver::start_on(addr).await;
    let got = receiver.wait_for(20, 20 * SECOND).await;
    let mut ids: Vec<String> = got
        .iter()
        .filter_map(|r| r.header("x-redisched-id"))
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 20, "every job delivered once up");
    for i in 0..20 {
        released(&store, "down", &format!("j{i}")).await;
    }
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_from_a_jobs_own_url_parks_that_job_after_max_attempts_and_a_redrive_delivers_it() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.set_default(Answer::status(410).body("gone"));
    // The job's own URL answers 410: that job is retried and parked as before; the
    // target stays enabled (a 410 from the target's own URL disables it instead:
    // tests/bridge/target_health.rs).
    let mut hook = target("gone", &["gone"], receiver.url("/r"));
    hook.allowed_url_prefixes = vec![receiver.url("/own/")];
    hook.allow_private_job_urls = true;
    let mut config = config_with("hook410", vec![hook]);
    config.dispatch.max_attempts = 3;
    config.dispatch.retry_min_ms = 100;
    config.dispatch.retry_max_ms = 200;
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    let own = receiver.url("/own/j1");
    broker
        .put("gone", "j1", b"x", &[("x-redisched-url", text(&own))])
        .await;
    let parked = wait_for(&store, "gone", "j1", |j| {
        j.is_some_and(|j| j.state == JobState::Parked)
    })
    .await
    .unwrap();
    assert_eq!(parked.failures, 3);
    assert_eq!(
        parked.last_error.map(|e| e.reason).as_deref(),
        Some("HTTP 410 Gone from gone: gone")
    );
    tokio::time::sleep(SECOND).await;
    assert_eq!(receiver.received().len(), 3, "parked: no more attempts");
    receiver.set_default(Answer::status(204));
    let (topic, id) = (Topic::new("gone").unwrap(), JobId::new("j1").unwrap());
    assert!(store.redrive(&topic, &id).await.unwrap());
    released(&store, "gone", "j1").await;
    assert_eq!(receiver.received().len(), 4);
    let t = &config.targets[0];
    let health = store
        .target_health(&t.name, &t.breaker, redisched::store::HealthOp::Get)
        .await
        .unwrap();
    assert_eq!(
        health.state,
        redisched::targets::health::State::Closed,
        "a job's own URL says nothing of the target's health"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_a_failure_and_is_not_followed() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let elsewhere = receiver.url("/elsewhere");
    receiver.script([Answer::status(302).header("location", &elsewhere)]);
    let config = config_with(
        "hook302",
        vec![target("moved", &["moved"], receiver.url("/r"))],
    );
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    broker.put("moved", "j1", b"x", &[]).await;
    let failing = wait_for(&store, "moved", "j1", |j| {
        j.is_some_and(|j| j.failures >= 1)
    })
    .await;
    let reason = failing.unwrap().last_error.unwrap().reason;
    assert!(reason.starts_with("HTTP 302 Found from moved"), "{reason}");
    released(&store, "moved", "j1").await;
    let paths: Vec<String> = receiver.received().into_iter().map(|r| r.path).collect();
    assert_eq!(
        paths,
        ["/r", "/r"],
        "the retry went to the target again, never to the Location"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_may_name_its_own_url_only_under_an_allowed_prefix() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let mut hook = target("tenants", &["tenants"], receiver.url("/default"));
    hook.allowed_url_prefixes = vec![receiver.url("/tenants/")];
    hook.allow_private_job_urls = true;
    let config = config_with("hookurl", vec![hook]);
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    let own = receiver.url("/tenants/acme/hook");
    broker
        .put(
            "tenants",
            "inside",
            b"x",
            &[("x-redisched-url", text(&own))],
        )
        .await;
    broker
        .put(
            "tenants",
            "outside",
            b"x",
            &[("x-redisched-url", text("http://127.0.0.1:9/latest"))],
        )
        .await;
    broker
        .put(
            "not-a-target",
            "no-target",
            b"x",
            &[("x-redisched-url", text(&own))],
        )
        .await;
    broker.put("tenants", "plain", b"x", &[]).await;

    let set_aside = invalid.collect(2, 10 * SECOND).await;
    assert_eq!(set_aside.len(), 2);
    let reasons: Vec<(String, String)> = set_aside
        .iter()
        .map(|(_, d)| {
            (
                message_id(d),
                header_text(d, "x-redisched-error").unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(reasons[0].0, "outside");
    assert!(
        reasons[0]
            .1
            .contains("not under any of target tenants's allowed_url_prefixes"),
        "{reasons:?}"
    );
    assert_eq!(reasons[1].0, "no-target");
    assert!(
        reasons[1]
            .1
            .contains("no webhook target serves topic not-a-target"),
        "{reasons:?}"
    );

    released(&store, "tenants", "inside").await;
    released(&store, "tenants", "plain").await;
    let mut paths: Vec<(String, String)> = receiver
        .received()
        .into_iter()
        .map(|r| (r.header("x-redisched-id").unwrap(), r.path))
        .collect();
    paths.sort();
    assert_eq!(
        paths,
        [
            ("inside".to_string(), "/tenants/acme/hook".to_string()),
            ("plain".to_string(), "/default".to_string())
        ]
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_body_is_exactly_topic_id_and_contents() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let mut hook = target("seed", &["seed"], receiver.url("/receive"));
    hook.body = "seed".into();
    let config = config_with("hookseed", vec![hook]);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);

    broker.put("seed", "order-7", b"hello", &[]).await;
    let got = receiver.wait_for(1, 10 * SECOND).await;
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].header("content-type").as_deref(),
        Some("application/json")
    );
    let body: serde_json::Value = serde_json::from_slice(&got[0].body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"topic": "seed", "id": "order-7", "contents": "hello"})
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signatures_verify_with_the_standard_webhooks_library_for_both_secrets_of_a_rotation() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let mut hook = target("signed", &["signed"], receiver.url("/r"));
    hook.signing_secrets = vec![SECRET_A.into(), SECRET_B.into()];
    let config = config_with("hooksig", vec![hook]);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);

    broker
        .put(
            "signed",
            "j1",
            // JSON: the library parses the body once the signature matched.
            r#"{"note": "ünïcode"}"#.as_bytes(),
            &[],
        )
        .await;
    let got = receiver.wait_for(1, 10 * SECOND).await;
    assert_eq!(got.len(), 1);
    let signature = got[0].header("webhook-signature").unwrap();
    assert_eq!(
        signature.split(' ').count(),
        2,
        "one signature per secret: {signature}"
    );
    for verifier in verifiers::ALL {
        for secret in [SECRET_A, SECRET_B] {
            if let Err(out) = verifier.verify(&got[0], secret) {
                panic!(
                    "{} refused the signature for {secret}: {out}",
                    verifier.name()
                );
            }
        }
        // A secret that did not sign fails: the check is not vacuous.
        assert!(verifier
            .verify(&got[0], "whsec_bm90IHRoZSBzZWNyZXQ=")
            .is_err());
    }
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: bash scripts/test.sh runs it"]
async fn a_dead_target_with_a_large_backlog_delays_neither_amqp_topics_nor_other_targets() {
    let _alone = common::timed::alone().await;
    use redisched::job::{Due, PutMode};
    use redisched::store::{Op, PutRequest};
    // The dead target accepts connections and never answers.
    let dead = Receiver::start().await;
    dead.set_default(Answer::status(200).delay(Duration::from_secs(120)));
    let live = Receiver::start().await;
    let mut dead_hook = target("dead", &["dead"], dead.url("/r"));
    dead_hook.timeout_ms = 1_000;
    dead_hook.max_in_flight = 16;
    let live_hook = target("live", &["live"], live.url("/r"));
    let mut config = config_with("hookiso", vec![dead_hook, live_hook]);
    config.dispatch.max_attempts = 0;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("ontime").await;
    let store = common::test_store_named(&config.redis.prefix).await;

    // 10,000 jobs of the dead target, due now.
    let topic = Topic::new("dead").unwrap();
    for chunk in (0..10_000).collect::<Vec<_>>().chunks(500) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|i| {
                Op::Put(PutRequest {
                    topic: topic.clone(),
                    id: JobId::new(format!("d{i}")).unwrap(),
                    body: b"x".to_vec(),
                    meta: Vec::new(),
                    due: Due::NOW,
                    mode: PutMode::Keep,
                })
            })
            .collect();
        store.apply(&ops).await.expect("put the backlog");
    }
    let bridge = InProcess::start(&config);
    // Let the dead target's slots fill up before the on-time jobs fall due.
    dead.wait_for(16, 10 * SECOND).await;

    let jobs = 150;
    let start = now_ms() + 1_500;
    for i in 0..jobs {
        let due = start + i * 20;
        let at = [("x-deliver-at", AMQPValue::LongLongInt(due))];
        broker.put("ontime", &format!("a{i}"), b"x", &at).await;
        broker.put("live", &format!("l{i}"), b"x", &at).await;
    }
    let amqp = ready.collect(jobs as usize, 30 * SECOND).await;
    let hooks = live.wait_for(jobs as usize, 30 * SECOND).await;
    assert_eq!(amqp.len(), jobs as usize, "every AMQP job delivered");
    assert_eq!(
        hooks.len(),
        jobs as usize,
        "every job of the live target delivered"
    );

    let mut amqp_late: Vec<i64> = amqp
        .iter()
        .map(|(at, d)| at - header_i64(d, "x-redisched-due-at").unwrap())
        .collect();
    let mut hook_late: Vec<i64> = hooks
        .iter()
        .map(|r| {
            r.epoch_ms
                - r.header("x-redisched-due-at")
                    .unwrap()
                    .parse::<i64>()
                    .unwrap()
        })
        .collect();
    amqp_late.sort_unstable();
    hook_late.sort_unstable();
    eprintln!(
        "lateness ms beside a dead target with 10,000 due jobs: AMQP p50 {} p99 {} max {}; live target p50 {} p99 {} max {}; dead target requests {}",
        percentile(&amqp_late, 0.5),
        percentile(&amqp_late, 0.99),
        amqp_late[amqp_late.len() - 1],
        percentile(&hook_late, 0.5),
        percentile(&hook_late, 0.99),
        hook_late[hook_late.len() - 1],
        dead.received().len(),
    );
    assert!(amqp_late[0] >= 0 && hook_late[0] >= 0, "never early");
    assert!(percentile(&amqp_late, 0.99) <= 50, "AMQP p99 {amqp_late:?}");
    assert!(
        percentile(&hook_late, 0.99) <= 50,
        "live target p99 {hook_late:?}"
    );
    // The dead target never had more than its cap in flight.
    let in_flight = store.stats(&topic).await.expect("stats").reserved;
    assert!(
        in_flight <= 16,
        "{in_flight} reserved for a target of max_in_flight 16"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_bridges_one_sigkilled_mid_request_lose_nothing() {
    let _shared = common::timed::shared().await;
    use std::collections::HashMap;
    let receiver = Receiver::start().await;
    receiver.set_default(Answer::status(200).delay(Duration::from_millis(100)));
    let mut hook = target("kill", &["kill"], receiver.url("/r"));
    hook.max_in_flight = 8;
    hook.timeout_ms = 1_000;
    let mut config = config_with("hookkill", vec![hook]);
    config.dispatch.ttr_ms = 2_000;
    let broker = Broker::new(&config).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let jobs = 300;
    for i in 0..jobs {
        broker.put("kill", &format!("k{i}"), b"x", &[]).await;
    }

    // The child gets its targets from a config file (they have no env form).
    let dir = common::faults::TempDir::new("hookkill");
    let file = dir.path().join("targets.toml");
    #[derive(serde::Serialize)]
    struct TargetsOnly<'a> {
        targets: &'a [TargetConfig],
    }
    let toml = toml::to_string(&TargetsOnly {
        targets: &config.targets,
    })
    .unwrap();
    std::fs::write(&file, toml).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("--config")
        .arg(&file)
        .arg("run")
        .envs(config.to_env())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn redisched run");
    // Kill it while its first requests are still waiting for their answer.
    let first = receiver.wait_for(1, 15 * SECOND).await;
    assert!(!first.is_empty(), "the child bridge delivers");
    tokio::time::sleep(Duration::from_millis(30)).await;
    child.kill().unwrap();
    child.wait().unwrap();
    let before_others = receiver.received().len();

    let (b2, b3) = (InProcess::start(&config), InProcess::start(&config));
    let deadline = Instant::now() + 30 * SECOND;
    loop {
        let stats = store.stats(&Topic::new("kill").unwrap()).await.unwrap();
        if stats.scheduled + stats.reserved == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "jobs left: {stats:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    for r in receiver.received() {
        *counts
            .entry(r.header("x-redisched-id").unwrap())
            .or_default() += 1;
    }
    let duplicates: usize = counts.values().map(|n| n - 1).sum();
    eprintln!(
        "{} of {jobs} ids delivered, {duplicates} duplicates; {before_others} requests before the SIGKILL",
        counts.len()
    );
    assert_eq!(counts.len(), jobs, "none lost");
    // Only what the killed bridge had in flight (its max_in_flight) is sent again.
    assert!(duplicates <= 8, "{duplicates} duplicates");
    b2.stop().await;
    b3.stop().await;
    broker.cleanup().await;
}

/// Runs `openssl` with whitespace-separated `args` in `dir`.
fn openssl(dir: &std::path::Path, args: &str) {
    let out = std::process::Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .expect("run openssl (is it installed?)");
    assert!(
        out.status.success(),
        "openssl {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A private CA (`ca.pem`) and a server certificate it signed for 127.0.0.1
/// (`server.pem`, `server.key`), made in `dir` for this run.
fn private_ca_certificates(dir: &std::path::Path) {
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName = IP:127.0.0.1, DNS:localhost\nbasicConstraints = critical, CA:FALSE\nextendedKeyUsage = serverAuth\n",
    )
    .unwrap();
    openssl(dir, "req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.pem -subj /CN=redisched-webhook-test-ca -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign");
    openssl(
        dir,
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
    );
    openssl(dir, "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out server.pem -extfile server.ext");
}

/// An HTTPS receiver (Python's http.server behind ssl) with a certificate of a private
/// CA made for this run; answers 200 to every POST. Returns the child and its port.
fn https_receiver(dir: &std::path::Path) -> (std::process::Child, u16) {
    private_ca_certificates(dir);
    let script = r#"
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get('content-length', 0)))
        self.send_response(200)
        self.send_header('content-length', '0')
        self.end_headers()
    def log_message(self, *args):
        pass
srv = http.server.HTTPServer(('127.0.0.1', 0), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain('server.pem', 'server.key')
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    use std::io::BufRead as _;
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line.trim().parse().expect("the receiver's port");
    (child, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_a_private_ca_is_trusted_only_through_tls_ca_file() {
    let _shared = common::timed::shared().await;
    let dir = common::faults::TempDir::new("hooktls");
    let (mut server, port) = https_receiver(dir.path());
    let url = format!("https://127.0.0.1:{port}/r");
    let mut trusting = target("trusting", &["trusting"], url.clone());
    trusting.tls_ca_file = dir.path().join("ca.pem").display().to_string();
    let untrusting = target("untrusting", &["untrusting"], url);
    let config = config_with("hooktls", vec![trusting, untrusting]);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    broker.put("trusting", "j1", b"x", &[]).await;
    broker.put("untrusting", "j2", b"x", &[]).await;
    released(&store, "trusting", "j1").await;
    let failing = wait_for(&store, "untrusting", "j2", |j| {
        j.is_some_and(|j| j.failures >= 1)
    })
    .await;
    let reason = failing.unwrap().last_error.unwrap().reason;
    assert!(
        reason.starts_with("request to untrusting") && reason.contains("TLS failed"),
        "{reason}"
    );
    bridge.stop().await;
    broker.cleanup().await;
    let _ = server.kill();
    let _ = server.wait();
}

/// An HTTPS server that offers HTTP/2 (hypercorn, ALPN `h2` then `http/1.1`), with a
/// certificate of a private CA, answering 200 and printing each request's HTTP version.
/// Returns the child, its port and its output (one `http_version <v>` line a request).
fn h2_receiver(
    dir: &std::path::Path,
) -> (
    std::process::Child,
    u16,
    std::io::BufReader<std::process::ChildStdout>,
) {
    private_ca_certificates(dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let script = r#"
import asyncio, sys
from hypercorn.asyncio import serve
from hypercorn.config import Config

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
                print("ready", flush=True)
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    while (await receive()).get("more_body"):
        pass
    print("http_version", scope["http_version"], flush=True)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})

config = Config()
config.bind = ["127.0.0.1:" + sys.argv[1]]
config.certfile, config.keyfile = "server.pem", "server.key"
config.alpn_protocols = ["h2", "http/1.1"]
config.accesslog = config.errorlog = None
asyncio.run(serve(app, config))
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script, &port.to_string()])
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3");
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    use std::io::BufRead as _;
    out.read_line(&mut line).expect("the receiver's first line");
    assert_eq!(
        line.trim(),
        "ready",
        "hypercorn did not start (bash scripts/webhook-deps.sh installs it)"
    );
    (child, port, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_is_used_when_the_server_offers_it() {
    let _shared = common::timed::shared().await;
    let dir = common::faults::TempDir::new("hookh2");
    let (mut server, port, mut out) = h2_receiver(dir.path());
    let mut hook = target("h2", &["h2"], format!("https://127.0.0.1:{port}/r"));
    hook.tls_ca_file = dir.path().join("ca.pem").display().to_string();
    let config = config_with("hookh2", vec![hook]);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    broker.put("h2", "j1", b"x", &[]).await;
    released(&store, "h2", "j1").await;
    let mut line = String::new();
    use std::io::BufRead as _;
    out.read_line(&mut line).expect("the request's line");
    assert_eq!(line.trim(), "http_version 2", "negotiated over ALPN");
    bridge.stop().await;
    broker.cleanup().await;
    let _ = server.kill();
    let _ = server.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_faces_list_targets_name_a_topics_target_and_count_requests() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    receiver.script([Answer::status(503).header("retry-after", "0")]);
    let mut hook = target("billing", &["billing"], receiver.url("/r"));
    hook.allowed_url_prefixes = vec![receiver.url("/own/")];
    hook.allow_private_job_urls = true;
    let mut config = config_with("hookfaces", vec![hook]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{port}");
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    // Wait for the API.
    let deadline = Instant::now() + 10 * SECOND;
    while http.get(format!("{base}/healthz")).send().await.is_err() {
        assert!(Instant::now() < deadline, "the API never came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // REST put with a URL: under the prefix accepted, elsewhere refused with the reason.
    let own = receiver.url("/own/a");
    let put = |url: String| {
        http.put(format!("{base}/v1/topics/billing/jobs/rest-1"))
            .query(&[("url", url)])
            .body("x")
            .send()
    };
    let refused = put("http://127.0.0.1:9/".into()).await.unwrap();
    assert_eq!(refused.status(), 422);
    let text = refused.text().await.unwrap();
    assert!(text.contains("allowed_url_prefixes"), "{text}");
    assert_eq!(put(own.clone()).await.unwrap().status(), 201);
    released(&store, "billing", "rest-1").await;
    let paths: Vec<String> = receiver.received().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/own/a", "/own/a"], "503 first, then the 2xx");

    let targets: serde_json::Value = http
        .get(format!("{base}/v1/targets"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let row = &targets["targets"][0];
    assert_eq!(row["name"], "billing");
    assert_eq!(row["topics"], serde_json::json!(["billing"]));
    assert_eq!(row["delivered"], 1);
    assert_eq!(row["failures"], 1);
    assert_eq!(row["last_status"], "200");
    assert_eq!(row["in_flight"], 0);
    assert_eq!(row["failing"], false);

    let topics: serde_json::Value = http
        .get(format!("{base}/v1/topics"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let billing = topics["topics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["topic"] == "billing")
        .cloned()
        .expect("the topic is listed");
    assert_eq!(billing["target"], "billing");

    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        r#"redisched_webhook_requests_total{target="billing",code="2xx"} 1"#,
        r#"redisched_webhook_requests_total{target="billing",code="5xx"} 1"#,
        r#"redisched_webhook_request_seconds_count{target="billing"} 2"#,
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_delivery_goes_on_while_the_broker_is_unreachable() {
    let _shared = common::timed::shared().await;
    use redisched::job::{Due, PutMode};
    use redisched::store::{Op, PutRequest};
    let receiver = Receiver::start().await;
    let mut config = config_with(
        "hooknobroker",
        vec![target("nobroker", &["nobroker"], receiver.url("/r"))],
    );
    // Nothing listens there: the bridge's AMQP sessions never open.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    config.amqp.url = format!("amqp://guest:guest@{dead}/%2f");
    let store = common::test_store_named(&config.redis.prefix).await;
    let bridge = InProcess::start(&config);
    // Jobs arrive through the store (REST or CLI would do the same), due in a moment.
    let topic = Topic::new("nobroker").unwrap();
    let ops: Vec<Op> = (0..5)
        .map(|i| {
            Op::Put(PutRequest {
                topic: topic.clone(),
                id: JobId::new(format!("n{i}")).unwrap(),
                body: b"x".to_vec(),
                meta: Vec::new(),
                due: Due::delay("delay", 300, 300).unwrap(),
                mode: PutMode::Keep,
            })
        })
        .collect();
    store.apply(&ops).await.expect("put");
    let got = receiver.wait_for(5, 10 * SECOND).await;
    assert_eq!(got.len(), 5, "delivered without a broker");
    for i in 0..5 {
        released(&store, "nobroker", &format!("n{i}")).await;
    }
    bridge.stop().await;
    redisched_testkit::delete_prefix(&config.redis.url, &config.redis.prefix).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_occurrence_of_a_series_gets_its_own_webhook_id() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let config = config_with(
        "hookseries",
        vec![target("series", &["series"], receiver.url("/r"))],
    );
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    broker
        .put(
            "series",
            "tick",
            b"x",
            &[("x-redisched-every", AMQPValue::LongLongInt(1_000))],
        )
        .await;
    let got = receiver.wait_for(2, 10 * SECOND).await;
    assert!(got.len() >= 2, "two occurrences");
    let due: Vec<String> = got
        .iter()
        .map(|r| r.header("x-redisched-due-at").unwrap())
        .collect();
    assert_ne!(due[0], due[1], "two occurrences");
    assert_ne!(got[0].header("webhook-id"), got[1].header("webhook-id"));
    bridge.stop().await;
    broker.cleanup().await;
}

/// `redisched <args>` with `file` as its config; (exit code, stdout, stderr).
fn cli(file: &std::path::Path, config: &Config, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("--config")
        .arg(file)
        .args(args)
        .envs(config.to_env())
        .output()
        .expect("run redisched");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_cli_lists_targets_checks_them_naming_the_key_and_guards_put_url() {
    let _shared = common::timed::shared_blocking();
    let dir = common::faults::TempDir::new("hookcli");
    let config = test_config("hookcli");
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        r#"
[[targets]]
name = "billing"
topics = ["billing.#"]
url = "http://127.0.0.1:9191/receive"
allowed_url_prefixes = ["http://127.0.0.1:9191/own/"]
"#,
    )
    .unwrap();
    // Jobs of its topics (and of one it does not serve) are counted from Redis.
    for (topic, id) in [("billing.eu", "a"), ("billing.us", "b"), ("mail", "c")] {
        let (code, _, err) = cli(&good, &config, &["put", topic, id, "x", "--delay", "1h"]);
        assert_eq!(code, 0, "{err}");
    }
    let (code, out, err) = cli(&good, &config, &["targets", "--json"]);
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["targets"][0]["name"], "billing");
    assert_eq!(
        json["targets"][0]["topics"],
        serde_json::json!(["billing.#"])
    );
    assert_eq!(
        json["targets"][0]["backlog"],
        serde_json::json!({"topics": 2, "scheduled": 2, "due_now": 0, "reserved": 0, "failing": 0, "parked": 0}),
        "{json}"
    );
    let (_, human, _) = cli(&good, &config, &["targets"]);
    assert!(human.contains("2 topic(s): 2 scheduled"), "{human}");
    common::delete_prefix(&config.redis.prefix);

    let (code, _, err) = cli(
        &good,
        &config,
        &[
            "put",
            "billing.eu",
            "j1",
            "x",
            "--url",
            "http://127.0.0.1:9/",
        ],
    );
    assert_eq!(code, 2, "refused: {err}");
    assert!(err.contains("allowed_url_prefixes"), "{err}");

    for (body, key) in [
        ("name = \"a\"\ntopics = [\"x\"]\nurl = \"ftp://h/\"", "targets[0].url"),
        ("name = \"a\"\ntopics = [\"x\"]\nurl = \"http://h/\"\nbody = \"json\"", "targets[0].body"),
        (
            "name = \"a\"\ntopics = [\"x\"]\nurl = \"http://h/\"\nsigning_secrets = [\"plain\"]",
            "targets[0].signing_secrets[0]",
        ),
        (
            "name = \"a\"\ntopics = [\"#\"]\nurl = \"http://h/\"\n[[targets]]\nname = \"b\"\ntopics = [\"x.y\"]\nurl = \"http://h/\"",
            "targets[1].topics[0]",
        ),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, format!("[[targets]]\n{body}\n")).unwrap();
        let (code, _, err) = cli(&bad, &config, &["check-config"]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(&format!("config key `{key}`")), "{key}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_proxy_variable_is_honoured() {
    let _shared = common::timed::shared().await;
    // The receiver plays the proxy: with HTTP_PROXY set, the bridge sends the request
    // for a host that does not exist to it (absolute-form request line).
    let proxy = Receiver::start().await;
    let config = config_with(
        "hookproxy",
        vec![target(
            "proxied",
            &["proxied"],
            "http://no-such-host.invalid/hook".into(),
        )],
    );
    let broker = Broker::new(&config).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let dir = common::faults::TempDir::new("hookproxy");
    let file = dir.path().join("targets.toml");
    #[derive(serde::Serialize)]
    struct TargetsOnly<'a> {
        targets: &'a [TargetConfig],
    }
    std::fs::write(
        &file,
        toml::to_string(&TargetsOnly {
            targets: &config.targets,
        })
        .unwrap(),
    )
    .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("--config")
        .arg(&file)
        .arg("run")
        .envs(config.to_env())
        .env("HTTP_PROXY", format!("http://{}", proxy.addr))
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn redisched run");
    broker.put("proxied", "p1", b"x", &[]).await;
    let got = proxy.wait_for(1, 15 * SECOND).await;
    assert_eq!(got.len(), 1, "the request went through the proxy");
    assert_eq!(got[0].path, "/hook");
    assert_eq!(
        got[0].header("host").as_deref(),
        Some("no-such-host.invalid")
    );
    released(&store, "proxied", "p1").await;
    child.kill().unwrap();
    child.wait().unwrap();
    broker.cleanup().await;
}

#[test]
fn check_config_masks_target_secrets() {
    let _shared = common::timed::shared_blocking();
    let dir = common::faults::TempDir::new("hookmask");
    let config = test_config("hookmask");
    let file = dir.path().join("t.toml");
    std::fs::write(
        &file,
        format!(
            "[[targets]]\nname = \"a\"\ntopics = [\"x\"]\nurl = \"http://user:pw@h/\"\nsigning_secrets = [\"{SECRET_A}\", {{ secret = \"{SECRET_B}\", expires_at = \"2099-01-01T00:00:00Z\" }}]\nheaders = {{ authorization = \"Bearer top-secret\" }}\n"
        ),
    )
    .unwrap();
    let (code, out, err) = cli(&file, &config, &["check-config"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("[[targets]]"), "{out}");
    for secret in [SECRET_A, SECRET_B, "top-secret", ":pw@"] {
        assert!(!out.contains(secret), "{secret} printed:\n{out}");
    }
    // A table secret keeps its expiry, masked like the others.
    assert!(
        out.contains("{ secret = \"***\", expires_at = \"2099-01-01T00:00:00Z\" }"),
        "{out}"
    );
    let (code, out, err) = cli(&file, &config, &["check-config", "--json"]);
    assert_eq!(code, 0, "{err}");
    for secret in [SECRET_A, SECRET_B, "top-secret", ":pw@"] {
        assert!(!out.contains(secret), "{secret} printed:\n{out}");
    }
}

#[test]
fn check_config_warns_of_expired_and_expiring_signing_secrets() {
    let _shared = common::timed::shared_blocking();
    let dir = common::faults::TempDir::new("hooksecrets");
    let config = test_config("hooksecrets");
    let file = dir.path().join("t.toml");
    let rfc3339 = |from_now: Duration, later: bool| {
        let now = std::time::SystemTime::now();
        let at = if later {
            now + from_now
        } else {
            now - from_now
        };
        humantime::format_rfc3339_seconds(at).to_string()
    };
    let (expired, soon, later) = (
        rfc3339(Duration::from_secs(3_600), false),
        rfc3339(Duration::from_secs(2 * 86_400), true),
        rfc3339(Duration::from_secs(30 * 86_400), true),
    );
    let write = |secrets: &str| {
        std::fs::write(
            &file,
            format!(
                "[[targets]]\nname = \"quiet\"\ntopics = [\"q\"]\nurl = \"http://h/\"\nsigning_secrets = [\"{SECRET_A}\"]\n\n[[targets]]\nname = \"billing\"\ntopics = [\"billing.#\"]\nurl = \"http://h/\"\nsigning_secrets = {secrets}\n"
            ),
        )
        .unwrap();
    };
    write(&format!(
        "[{{ secret = \"{SECRET_A}\", expires_at = \"{expired}\" }}, {{ secret = \"{SECRET_B}\", expires_at = \"{soon}\" }}, {{ secret = \"{SECRET_A}\", expires_at = \"{later}\" }}]"
    ));
    let (code, out, err) = cli(&file, &config, &["check-config"]);
    assert_eq!(code, 0, "a warning leaves the exit code alone: {err}");
    assert!(
        out.contains("[[targets]]"),
        "the configuration is printed: {out}"
    );
    let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("warning: ")).collect();
    assert_eq!(warnings.len(), 2, "{err}");
    assert!(
        warnings[0].starts_with(&format!(
            "warning: targets[1].signing_secrets[0] of target billing expired at {expired} (1h"
        )) && warnings[0].contains(" ago): it no longer signs"),
        "{err}"
    );
    assert!(
        warnings[1].starts_with(&format!(
            "warning: targets[1].signing_secrets[1] of target billing expires at {soon} (in 1day 23h"
        )),
        "{err}"
    );
    assert!(
        !out.contains("warning"),
        "warnings go to stderr only: {out}"
    );
    // Nothing expiring within a week: nothing said.
    write(&format!(
        "[\"{SECRET_B}\", {{ secret = \"{SECRET_A}\", expires_at = \"{later}\" }}]"
    ));
    let (code, _, err) = cli(&file, &config, &["check-config", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("warning: targets"), "{err}");
}

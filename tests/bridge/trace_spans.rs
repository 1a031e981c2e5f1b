//! The bridge's own place in the trace: webhook requests carry `traceparent` and
//! `tracestate` as request headers (a receiver reading them joins the producer's trace),
//! and, exported over OTLP/HTTP to a real receiver decoding with PyPI
//! `opentelemetry-proto` (`bash scripts/otel-deps.sh`), the ingest span of the command and
//! a delivery span per attempt, for an AMQP and a webhook target, in the producer's trace;
//! a job that came due while its topic was paused says for how long
//! (`redisched.paused_ms`).

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::bridge::*;
use common::otlp::{attr, OtlpReceiver};
use common::receiver::{Answer, Receiver};
use redisched::config::Config;
use redisched::targets::TargetConfig;
use serde_json::Value;

use super::trace_context::{rest_put, traceparent, wait_for_api, with_api, REST_TRACE};

const SECOND: Duration = Duration::from_secs(1);
/// An AMQP producer's context (the W3C recommendation's second example).
const AMQP_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const AMQP_PARENT: &str = "b7ad6b7169203331";
const HOOK_PARENT: &str = "00f067aa0ba902b7";

/// `config` with a webhook target `hooks` for topic `hook`, answering at `receiver`.
fn with_hook(config: &mut Config, receiver: &Receiver) {
    config.targets = vec![TargetConfig {
        name: "hooks".into(),
        topics: vec!["hook".into()],
        url: receiver.url("/in"),
        timeout_ms: 2_000,
        ..TargetConfig::default()
    }];
    config.validate().expect("valid test config");
}

fn traced(parent: &str, state: &str) -> [(&'static str, lapin::types::AMQPValue); 2] {
    [("traceparent", text(parent)), ("tracestate", text(state))]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_requests_carry_the_stored_traceparent_whatever_forward_headers_says() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let mut config = test_config("hooktrace");
    let base = with_api(&mut config);
    with_hook(&mut config, &receiver);
    assert!(!config.targets[0].forward_headers);
    // A second target forwards the AMQP headers: the real ones are there as well.
    config.targets.push(TargetConfig {
        name: "forwarding".into(),
        topics: vec!["fwd".into()],
        forward_headers: true,
        ..config.targets[0].clone()
    });
    config.validate().expect("valid test config");
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    wait_for_api(&base).await;

    let from_amqp = traceparent(AMQP_TRACE, AMQP_PARENT);
    broker
        .put("hook", "amqp-1", b"x", &traced(&from_amqp, "rojo=1"))
        .await;
    broker.put("hook", "plain-1", b"x", &[]).await;
    broker
        .put("fwd", "fwd-1", b"x", &traced(&from_amqp, "rojo=1"))
        .await;
    let from_rest = traceparent(REST_TRACE, HOOK_PARENT);
    let status = rest_put(&base, "hook", "rest-1", 0, &[("traceparent", &from_rest)]).await;
    assert_eq!(status, 201);

    let got = receiver.wait_for(4, 15 * SECOND).await;
    assert_eq!(got.len(), 4, "{got:#?}");
    let by_id = |id: &str| {
        got.iter()
            .find(|r| r.header("x-redisched-id").as_deref() == Some(id))
            .unwrap_or_else(|| panic!("no request for {id}: {got:#?}"))
    };
    // Export off: the stored context unchanged, as real request headers.
    let amqp = by_id("amqp-1");
    assert_eq!(amqp.header("traceparent"), Some(from_amqp.clone()));
    assert_eq!(amqp.header("tracestate").as_deref(), Some("rojo=1"));
    assert_eq!(amqp.header("x-redisched-header-traceparent"), None);
    let rest = by_id("rest-1");
    assert_eq!(rest.header("traceparent"), Some(from_rest));
    assert_eq!(rest.header("tracestate"), None);
    let forwarded = by_id("fwd-1");
    assert_eq!(forwarded.header("traceparent"), Some(from_amqp.clone()));
    assert_eq!(forwarded.header("tracestate").as_deref(), Some("rojo=1"));
    assert_eq!(
        forwarded.header("x-redisched-header-traceparent"),
        Some(from_amqp.clone())
    );
    let plain = by_id("plain-1");
    assert_eq!(plain.header("traceparent"), None, "none stored, none sent");
    assert_eq!(plain.header("tracestate"), None);

    bridge.stop().await;
    broker.cleanup().await;
}

/// A `redisched run` child with `config`, its targets from a file (they have no env
/// form, the file lives as long as the child); killed on drop if still running.
struct Exporting(Child, #[allow(dead_code)] common::faults::TempDir);

impl Exporting {
    fn start(config: &Config) -> Self {
        #[derive(serde::Serialize)]
        struct TargetsOnly<'a> {
            targets: &'a [TargetConfig],
        }
        let dir = common::faults::TempDir::new("spans");
        let file = dir.path().join("targets.toml");
        let targets = TargetsOnly {
            targets: &config.targets,
        };
        std::fs::write(&file, toml::to_string(&targets).unwrap()).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_redisched"))
            .arg("--config")
            .arg(&file)
            .arg("run")
            .envs(config.to_env())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redisched run");
        Self(child, dir)
    }
}

impl Drop for Exporting {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

/// The spans of trace `trace` named `name` and carrying message id `id`, once `count`
/// of them arrived (in the order received).
async fn spans_of(
    receiver: &OtlpReceiver,
    trace: &str,
    name: &str,
    id: &str,
    count: usize,
) -> Vec<Value> {
    let ours = |s: &Value| {
        s["trace_id"] == trace && s["name"] == name && attr(s, "messaging.message.id") == id
    };
    let deadline = std::time::Instant::now() + 15 * SECOND;
    loop {
        let all = receiver.wait_for(15 * SECOND, &ours).await;
        let found: Vec<Value> = all.into_iter().filter(|s| ours(s)).collect();
        if found.len() >= count || std::time::Instant::now() > deadline {
            assert_eq!(found.len(), count, "{name} of {id}: {found:#?}");
            return found;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What every delivery span of a job says, whatever its sink; its `redisched.paused_ms`.
fn assert_delivery(span: &Value, id: &str, topic: &str, attempt: i64) -> i64 {
    assert_eq!(*attr(span, "messaging.operation.type"), "send", "{span}");
    assert_eq!(*attr(span, "messaging.message.id"), id);
    assert_eq!(*attr(span, "redisched.topic"), topic);
    assert_eq!(*attr(span, "redisched.attempt"), attempt, "{span}");
    assert_eq!(*attr(span, "redisched.throttled"), false);
    let due_at = attr(span, "redisched.due_at").as_i64().expect("due_at");
    let reserved_at = attr(span, "redisched.reserved_at")
        .as_i64()
        .expect("reserved_at");
    let due_ms = attr(span, "redisched.due_ms").as_i64().expect("due_ms");
    assert!(reserved_at >= due_at, "never early: {span}");
    assert_eq!(due_ms, reserved_at - due_at);
    let paused_ms = attr(span, "redisched.paused_ms")
        .as_i64()
        .expect("paused_ms");
    assert!(
        (0..=due_ms).contains(&paused_ms),
        "part of the due wait: {span}"
    );
    paused_ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridges_ingest_and_delivery_spans_join_the_producers_trace() {
    let _shared = common::timed::shared().await;
    let otlp = OtlpReceiver::start();
    let hook = Receiver::start().await;
    // The first attempt fails: each attempt is a span of its own.
    hook.script([Answer::status(503)]);
    let mut config = test_config("otlpspans");
    config.telemetry.otlp_endpoint = otlp.endpoint();
    config.telemetry.batch_delay_ms = 100;
    with_hook(&mut config, &hook);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("plain").await;
    let _bridge = Exporting::start(&config);

    let to_queue = traceparent(AMQP_TRACE, AMQP_PARENT);
    let to_hook = traceparent(AMQP_TRACE, HOOK_PARENT);
    broker
        .put("plain", "a-1", b"x", &traced(&to_queue, "rojo=1"))
        .await;
    broker
        .put("hook", "w-1", b"x", &traced(&to_hook, "rojo=2"))
        .await;

    let (_, delivered) = ready.next(20 * SECOND).await.expect("the AMQP job");
    let requests = hook.wait_for(2, 20 * SECOND).await;
    assert_eq!(requests.len(), 2, "503, then the retry");

    // Ingest: a consumer span per command, a child of the producer's publish.
    let commands = format!("process {}", config.amqp.commands_exchange);
    for (id, parent, topic) in [("a-1", AMQP_PARENT, "plain"), ("w-1", HOOK_PARENT, "hook")] {
        let ingest = &spans_of(&otlp, AMQP_TRACE, &commands, id, 1).await[0];
        assert_eq!(ingest["kind"], "consumer");
        assert_eq!(ingest["parent_span_id"], parent, "{ingest}");
        assert_eq!(*attr(ingest, "messaging.system"), "rabbitmq");
        assert_eq!(*attr(ingest, "messaging.operation.type"), "process");
        assert_eq!(
            *attr(ingest, "messaging.destination.name"),
            config.amqp.commands_exchange.as_str()
        );
        assert_eq!(
            *attr(ingest, "messaging.rabbitmq.destination.routing_key"),
            topic
        );
        assert_eq!(*attr(ingest, "redisched.outcome"), "scheduled");
        assert_eq!(ingest["status"]["code"], "unset");
    }

    // AMQP delivery: a producer span, a child of the stored context; the consumer's
    // parent is that span, in the producer's trace, with the producer's tracestate.
    let send = format!("send {}", config.amqp.ready_exchange);
    let publish = &spans_of(&otlp, AMQP_TRACE, &send, "a-1", 1).await[0];
    assert_eq!(publish["kind"], "producer");
    assert_eq!(publish["parent_span_id"], AMQP_PARENT);
    assert_eq!(*attr(publish, "messaging.system"), "rabbitmq");
    assert_eq!(
        *attr(publish, "messaging.destination.name"),
        config.amqp.ready_exchange.as_str()
    );
    assert_eq!(
        *attr(publish, "messaging.rabbitmq.destination.routing_key"),
        "plain"
    );
    assert_eq!(assert_delivery(publish, "a-1", "plain", 1), 0, "not paused");
    assert_eq!(*attr(publish, "redisched.outcome"), "confirmed");
    let publish_id = publish["span_id"].as_str().unwrap();
    assert_eq!(
        header_text(&delivered, "traceparent"),
        Some(format!("00-{AMQP_TRACE}-{publish_id}-01"))
    );
    assert_eq!(
        header_text(&delivered, "tracestate").as_deref(),
        Some("rojo=1")
    );

    // Webhook: a client span per attempt, each a child of the stored context; each
    // request's traceparent names its own attempt.
    let posts = spans_of(&otlp, AMQP_TRACE, "send hooks", "w-1", 2).await;
    let attempt = |n: i64| {
        posts
            .iter()
            .find(|s| *attr(s, "redisched.attempt") == n)
            .unwrap_or_else(|| panic!("attempt {n}: {posts:#?}"))
    };
    for (n, status, outcome, code) in [(1, 503, "retried", "error"), (2, 200, "delivered", "unset")]
    {
        let post = attempt(n);
        assert_eq!(post["kind"], "client");
        assert_eq!(post["parent_span_id"], HOOK_PARENT);
        assert_eq!(*attr(post, "messaging.system"), "http");
        assert_eq!(*attr(post, "messaging.destination.name"), "hooks");
        assert!(attr(post, "messaging.rabbitmq.destination.routing_key").is_null());
        assert_eq!(assert_delivery(post, "w-1", "hook", n), 0, "not paused");
        assert_eq!(*attr(post, "http.response.status_code"), status);
        assert_eq!(*attr(post, "redisched.outcome"), outcome);
        assert_eq!(post["status"]["code"], code, "{post}");
        let request = &requests[usize::try_from(n - 1).unwrap()];
        let own = post["span_id"].as_str().unwrap();
        assert_eq!(
            request.header("traceparent"),
            Some(format!("00-{AMQP_TRACE}-{own}-01"))
        );
        assert_eq!(request.header("tracestate").as_deref(), Some("rojo=2"));
    }

    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_due_while_its_topic_was_paused_says_for_how_long() {
    let _shared = common::timed::shared().await;
    let otlp = OtlpReceiver::start();
    let hook = Receiver::start().await;
    let mut config = test_config("otlppaused");
    config.telemetry.otlp_endpoint = otlp.endpoint();
    config.telemetry.batch_delay_ms = 100;
    with_hook(&mut config, &hook);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("plain").await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let topics = [("plain", "a-p"), ("hook", "w-p")].map(|(t, id)| {
        let topic = redisched::job::Topic::new(t).expect("topic");
        (topic, id)
    });
    let before = store.server_time().await.expect("time");
    for (topic, _) in &topics {
        assert!(store.pause(topic).await.expect("pause"));
    }
    let after = store.server_time().await.expect("time");
    let since = store.paused_at(&topics[0].0).await.expect("paused at");
    assert!(
        since.is_some_and(|at| (before..=after).contains(&at)),
        "{before} {since:?} {after}"
    );
    let _bridge = Exporting::start(&config);

    // Both come due once stored, in their paused topics: nothing is delivered until
    // the resume 1.5 s later, by either sink.
    let trace = traceparent(AMQP_TRACE, AMQP_PARENT);
    for (topic, id) in &topics {
        broker
            .put(topic.as_str(), id, b"x", &traced(&trace, "rojo=1"))
            .await;
    }
    let deadline = std::time::Instant::now() + 20 * SECOND;
    for (topic, id) in &topics {
        let id = redisched::job::JobId::new(*id).expect("id");
        while store.get(topic, &id).await.expect("get").is_none() {
            assert!(std::time::Instant::now() < deadline, "{id} never stored");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        ready.drain(Duration::from_millis(10)).await.is_empty(),
        "paused"
    );
    assert!(hook.received().is_empty(), "paused");
    for (topic, _) in &topics {
        assert!(store.resume(topic).await.expect("resume"));
    }
    assert!(store.paused_at(&topics[0].0).await.expect("read").is_none());
    ready.next(20 * SECOND).await.expect("the AMQP job");
    assert_eq!(hook.wait_for(1, 20 * SECOND).await.len(), 1);

    let send = format!("send {}", config.amqp.ready_exchange);
    for (name, (topic, id)) in [send.as_str(), "send hooks"].into_iter().zip(&topics) {
        let span = &spans_of(&otlp, AMQP_TRACE, name, id, 1).await[0];
        let paused_ms = assert_delivery(span, id, topic.as_str(), 1);
        assert!(paused_ms >= 1_000, "{span}");
        // Its whole due wait: it came due paused and was taken by the reserve that
        // found the topic running again, which ends the pause.
        assert_eq!(*attr(span, "redisched.due_ms"), paused_ms, "{span}");
    }

    broker.cleanup().await;
}

//! One trace across the delay, checked with libraries we did not write: producers and
//! consumers instrumented with PyPI `opentelemetry-instrumentation-pika`, and the bridge's
//! own spans exported over OTLP/HTTP to a receiver that decodes them with PyPI
//! `opentelemetry-proto` (`bash scripts/otel-deps.sh` installs both).

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::bridge::*;
use common::otlp::{attr, OtlpReceiver, HOW_TO_INSTALL};
use redisched::config::Config;
use serde_json::{json, Value};

const SECOND: Duration = Duration::from_secs(1);
/// A sender's context as a REST client would send it (the W3C recommendation's example).
pub(super) const REST_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
pub(super) const REST_PARENT: &str = "00f067aa0ba902b7";

pub(super) fn traceparent(trace: &str, parent: &str) -> String {
    format!("00-{trace}-{parent}-01")
}

/// `config` with its HTTP API on a free loopback port; the API's base URL.
pub(super) fn with_api(config: &mut Config) -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{port}");
    format!("http://127.0.0.1:{port}")
}

pub(super) async fn wait_for_api(base: &str) {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + 20 * SECOND;
    while http.get(format!("{base}/healthz")).send().await.is_err() {
        assert!(Instant::now() < deadline, "the API never came up at {base}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `PUT /v1/topics/{topic}/jobs/{id}?delay_ms=` with these request headers; the status.
pub(super) async fn rest_put(
    base: &str,
    topic: &str,
    id: &str,
    delay_ms: u64,
    headers: &[(&str, &str)],
) -> u16 {
    let mut request = reqwest::Client::new()
        .put(format!("{base}/v1/topics/{topic}/jobs/{id}"))
        .query(&[("delay_ms", delay_ms.to_string())])
        .body("from REST");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.expect("REST put").status().as_u16()
}

/// `POST /schedule/{topic}` (the seed interface) with these request headers; the status.
async fn seed_put(base: &str, topic: &str, id: &str, headers: &[(&str, &str)]) -> u16 {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/schedule/{topic}"))
        .json(&json!({ "id": id, "contents": "from the seed interface", "delay": 0.2 }));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.expect("seed put").status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pika_consumers_continue_the_producers_trace_across_the_delay() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("pikatrace");
    let base = with_api(&mut config);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    wait_for_api(&base).await;
    let topic = "reminders";
    let delay_ms = 700;

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/bridge/pika_tracing.py");
    let mut child = Command::new("python3")
        .arg(script)
        .args([
            &common::amqp_url(),
            &config.amqp.commands_exchange,
            &config.amqp.ready_exchange,
            topic,
            &delay_ms.to_string(),
            "rest-1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("python3: {e}; {HOW_TO_INSTALL}"));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let bound = tokio::task::block_in_place(|| lines.next());
    assert!(
        matches!(&bound, Some(Ok(line)) if line == "bound"),
        "the pika script did not start ({bound:?}); {HOW_TO_INSTALL}"
    );
    // A put over REST with a context of its own, consumed by the same pika consumer.
    let rest_parent = traceparent(REST_TRACE, REST_PARENT);
    let status = rest_put(
        &base,
        topic,
        "rest-1",
        300,
        &[("traceparent", &rest_parent), ("tracestate", "rojo=1")],
    )
    .await;
    assert_eq!(status, 201);
    let report = tokio::task::block_in_place(|| {
        let report = lines.next();
        child.wait().ok();
        report
    });
    let report: Value = match report {
        Some(Ok(line)) => serde_json::from_str(&line).expect("the script's report"),
        other => panic!("no report from the pika script: {other:?}"),
    };

    let spans = report["spans"].as_array().unwrap();
    let received = report["received"].as_array().unwrap();
    let sends: Vec<&Value> = spans.iter().filter(|s| s["kind"] == "PRODUCER").collect();
    assert_eq!(sends.len(), 3, "once, series and the delete: {spans:#?}");
    let producer_trace = sends[0]["trace_id"].as_str().unwrap();
    let once: Vec<&Value> = received.iter().filter(|r| r["id"] == "once").collect();
    let series: Vec<&Value> = received.iter().filter(|r| r["id"] == "series").collect();
    let rest: Vec<&Value> = received.iter().filter(|r| r["id"] == "rest-1").collect();
    assert_eq!(once.len(), 1, "{received:#?}");
    assert!(
        series.len() >= 2,
        "two occurrences of the series: {received:#?}"
    );
    assert_eq!(rest.len(), 1, "{received:#?}");

    // After the delay, in the producer's trace: the consumer's span continues the span
    // of the publish that scheduled it, whose traceparent was delivered unchanged.
    let sent = report["sent"].as_f64().unwrap();
    let arrived = once[0]["at"].as_f64().unwrap();
    assert!(
        arrived - sent >= 0.65,
        "not before the delay: {:.3} s",
        arrived - sent
    );
    for delivery in once.iter().chain(&series) {
        assert_eq!(
            delivery["trace_id"], producer_trace,
            "the consumer's span joins the producer's trace: {delivery}"
        );
    }
    let once_send = sends
        .iter()
        .find(|s| {
            once[0]["traceparent"]
                .as_str()
                .unwrap()
                .contains(s["span_id"].as_str().unwrap())
        })
        .expect("the delivered traceparent names a publish span of the producer");
    assert_eq!(once_send["trace_id"], producer_trace);
    // A series' later occurrences keep the context of the command that created it.
    assert_eq!(series[0]["traceparent"], series[1]["traceparent"]);
    let consumer_spans: Vec<&Value> = spans.iter().filter(|s| s["kind"] == "CONSUMER").collect();
    assert!(consumer_spans.len() >= 4, "{spans:#?}");
    for span in &consumer_spans {
        assert!(
            span["trace_id"] == producer_trace || span["trace_id"] == REST_TRACE,
            "{span}"
        );
    }

    // The REST put's context reached the consumer as given.
    assert_eq!(rest[0]["traceparent"], rest_parent.as_str());
    assert_eq!(rest[0]["tracestate"], "rojo=1");
    assert_eq!(rest[0]["trace_id"], REST_TRACE);
    let rest_span = consumer_spans
        .iter()
        .find(|s| s["span_id"] == rest[0]["span_id"])
        .expect("the consumer span of the REST job");
    assert_eq!(rest_span["parent_span_id"], REST_PARENT);

    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_series_keeps_the_context_of_the_put_that_created_or_last_replaced_it() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("seriestrace");
    let base = with_api(&mut config);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    wait_for_api(&base).await;
    let http = reqwest::Client::new();
    let put = |parent: String, mode: &'static str| {
        http.put(format!("{base}/v1/topics/s/jobs/series-1"))
            .query(&[("every", "1000"), ("mode", mode)])
            .header("traceparent", parent)
            .body("tick")
            .send()
    };
    let first = traceparent(REST_TRACE, REST_PARENT);
    let second = traceparent("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    assert_eq!(put(first.clone(), "put").await.unwrap().status(), 201);
    let (_, occurrence) = ready.next(10 * SECOND).await.expect("an occurrence");
    assert_eq!(header_text(&occurrence, "traceparent"), Some(first.clone()));
    let (_, occurrence) = ready.next(10 * SECOND).await.expect("a later occurrence");
    assert_eq!(
        header_text(&occurrence, "traceparent"),
        Some(first.clone()),
        "every occurrence carries the creating put's context"
    );

    assert_eq!(put(second.clone(), "replace").await.unwrap().status(), 200);
    // An occurrence already taken may still carry the first; from then on, the second.
    let mut seen = Vec::new();
    let deadline = Instant::now() + 10 * SECOND;
    while seen.iter().filter(|p: &&String| **p == second).count() < 2 {
        assert!(
            Instant::now() < deadline,
            "occurrences after the replace: {seen:?}"
        );
        if let Some((_, occurrence)) = ready.next(5 * SECOND).await {
            seen.push(header_text(&occurrence, "traceparent").unwrap_or_default());
        }
    }
    let from = seen.iter().position(|p| *p == second).unwrap();
    assert!(seen[from..].iter().all(|p| *p == second), "{seen:?}");
    assert!(
        from <= 1,
        "at most the occurrence in flight keeps the old one: {seen:?}"
    );

    let deleted = http
        .delete(format!("{base}/v1/topics/s/jobs/series-1"))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    bridge.stop().await;
    broker.cleanup().await;
}

/// A bridge exporting to `receiver`, its API up; the API's base URL.
async fn exporting_bridge(
    label: &str,
    receiver: &OtlpReceiver,
    batch_delay_ms: u64,
) -> (Config, String, ChildBridge) {
    let mut config = test_config(label);
    let base = with_api(&mut config);
    config.telemetry.otlp_endpoint = receiver.endpoint();
    config.telemetry.batch_delay_ms = batch_delay_ms;
    config.telemetry.service_name = format!("redisched-{label}");
    let bridge = ChildBridge::start(&config);
    wait_for_api(&base).await;
    (config, base, bridge)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_and_seed_puts_store_their_traceparent_and_export_their_spans() {
    let _shared = common::timed::shared().await;
    let receiver = OtlpReceiver::start();
    let (config, base, mut bridge) = exporting_bridge("otlpput", &receiver, 200).await;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;

    let given = traceparent(REST_TRACE, REST_PARENT);
    let seed_parent = "b7ad6b7169203331";
    let seed_given = traceparent(REST_TRACE, seed_parent);
    let headers = [
        ("traceparent", given.as_str()),
        ("tracestate", "rojo=00f067aa0ba902b7"),
    ];
    assert_eq!(rest_put(&base, "t", "traced", 200, &headers).await, 201);
    assert_eq!(
        seed_put(&base, "t", "seeded", &[("traceparent", &seed_given)]).await,
        201
    );
    // An invalid traceparent is ignored, not refused (uppercase hex is invalid).
    let invalid = given.to_uppercase();
    assert_eq!(
        rest_put(&base, "t", "untraced", 0, &[("traceparent", &invalid)]).await,
        201
    );

    let got = ready.collect(3, 15 * SECOND).await;
    assert_eq!(got.len(), 3);
    for (_, job) in &got {
        let parent = header_text(job, "traceparent");
        match message_id(job).as_str() {
            "traced" => {
                // Exported: the delivery span's context, in the caller's trace, with
                // the caller's tracestate (trace_spans.rs checks the span itself).
                let parent = parent.expect("a traceparent");
                assert!(parent.starts_with(&format!("00-{REST_TRACE}-")), "{parent}");
                assert_ne!(
                    parent, given,
                    "the delivery attempt is the consumer's parent"
                );
                assert_eq!(
                    header_text(job, "tracestate").as_deref(),
                    Some("rojo=00f067aa0ba902b7")
                );
            }
            "seeded" => {
                let parent = parent.expect("a traceparent");
                assert!(parent.starts_with(&format!("00-{REST_TRACE}-")), "{parent}");
                assert_ne!(parent, seed_given);
            }
            "untraced" => {
                // The invalid one was not stored: the delivery span started a trace of
                // its own, and the consumer joins that one.
                let parent = parent.expect("the delivery span's context");
                assert!(!parent.contains(REST_TRACE), "{parent}");
                assert_eq!(header_text(job, "tracestate"), None);
            }
            other => panic!("unexpected job {other}"),
        }
    }

    // The bridge's spans of the two traced puts, children of the callers' spans.
    // (Their delivery spans share trace and parent: the put's is the server span.)
    let is_ours = |s: &Value, parent: &str| {
        s["trace_id"] == REST_TRACE && s["parent_span_id"] == parent && s["kind"] == "server"
    };
    let spans = receiver
        .wait_for(10 * SECOND, |s| is_ours(s, seed_parent))
        .await;
    let spans = if spans.iter().any(|s| is_ours(s, REST_PARENT)) {
        spans
    } else {
        receiver
            .wait_for(10 * SECOND, |s| is_ours(s, REST_PARENT))
            .await
    };
    let put = spans.iter().find(|s| is_ours(s, REST_PARENT)).unwrap();
    assert_eq!(put["name"], "PUT /v1/topics/{topic}/jobs/{id}");
    assert_eq!(put["kind"], "server");
    assert_eq!(*attr(put, "http.request.method"), "PUT");
    assert_eq!(*attr(put, "http.route"), "/v1/topics/{topic}/jobs/{id}");
    assert_eq!(*attr(put, "redisched.topic"), "t");
    assert_eq!(*attr(put, "redisched.id"), "traced");
    assert_eq!(*attr(put, "http.response.status_code"), 201);
    assert_eq!(put["resource"]["service.name"], "redisched-otlpput");
    assert_eq!(put["status"]["code"], "unset");
    let seed = spans.iter().find(|s| is_ours(s, seed_parent)).unwrap();
    assert_eq!(seed["name"], "POST /schedule/{topic}");
    assert_eq!(*attr(seed, "redisched.id"), "seeded");
    // The put with an invalid context started a trace of its own.
    let spans = receiver
        .wait_for(10 * SECOND, |s| attr(s, "redisched.id") == "untraced")
        .await;
    let own = spans
        .iter()
        .find(|s| attr(s, "redisched.id") == "untraced")
        .unwrap();
    assert_ne!(own["trace_id"], REST_TRACE);
    assert_eq!(own["parent_span_id"], "");
    // Only our spans are exported: no span of the bridge's log or libraries.
    for span in &spans {
        assert!(
            attr(span, "redisched.topic").is_string(),
            "a span that is not one of ours: {span}"
        );
    }

    let (status, _) = bridge.terminate();
    assert!(status.success(), "{status}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_still_queued_are_sent_at_shutdown() {
    let _shared = common::timed::shared().await;
    let receiver = OtlpReceiver::start();
    // A batch delay far beyond the test: only the flush at shutdown can send the span.
    let (config, base, mut bridge) = exporting_bridge("otlpflush", &receiver, 600_000).await;
    let broker = Broker::new(&config).await;
    let given = traceparent(REST_TRACE, REST_PARENT);
    assert_eq!(
        rest_put(&base, "t", "last", 60_000, &[("traceparent", &given)]).await,
        201
    );
    tokio::time::sleep(SECOND).await;
    assert!(
        receiver.spans().is_empty(),
        "nothing sent before the batch delay"
    );
    let (status, _) = bridge.terminate();
    assert!(status.success(), "{status}");
    let spans = receiver
        .wait_for(5 * SECOND, |s| attr(s, "redisched.id") == "last")
        .await;
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert_eq!(spans[0]["parent_span_id"], REST_PARENT);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_standard_endpoint_stops_the_start_naming_the_variable() {
    let config = test_config("otlpbad");
    let out = Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("run")
        .env_clear()
        .envs(config.to_env())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")
        .output()
        .expect("run the binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_ENDPOINT: expected an http"),
        "{stderr}"
    );
}

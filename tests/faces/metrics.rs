//! `GET /metrics` of a running bridge as Prometheus and promtool see it: the format
//! follows `Accept`, the classic text passes `promtool check metrics`, every family is
//! there before its first use, and a drained topic's series go away.

use crate::common;

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::bridge::*;
use common::faults::free_port;
use lapin::types::AMQPValue;

const SECOND: Duration = Duration::from_secs(1);
const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";
const OPEN_METRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const HOW_TO_INSTALL_PROMTOOL: &str =
    "promtool is missing: install it with `bash scripts/deploy-deps.sh` (Debian package `prometheus`)";

/// GETs `/metrics` with `accept` (none if `None`): (content type, body).
async fn scrape(base: &str, accept: Option<&str>) -> (String, String) {
    let client = reqwest::Client::new();
    let mut request = client.get(format!("{base}/metrics"));
    if let Some(accept) = accept {
        request = request.header("accept", accept);
    }
    let response = request.send().await.expect("GET /metrics");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["vary"], "accept");
    let content_type = response.headers()["content-type"]
        .to_str()
        .expect("content type")
        .to_string();
    (content_type, response.text().await.expect("body"))
}

/// `promtool check metrics` over `text`: (success, everything it printed).
fn promtool_check_metrics(text: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot run promtool: {err}\n{HOW_TO_INSTALL_PROMTOOL}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let output = child.wait_with_output().expect("promtool output");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), printed)
}

/// Python prometheus-client's strict OpenMetrics parser over `text`: the families it read
/// (name and type, one per line), or what it objected to.
fn parse_open_metrics(text: &str) -> Result<String, String> {
    const PARSE: &str = "import sys\n\
        from prometheus_client.openmetrics.parser import text_string_to_metric_families\n\
        for f in text_string_to_metric_families(sys.stdin.read()):\n    print(f.name, f.type, len(f.samples))\n";
    let mut child = Command::new("python3")
        .args(["-c", PARSE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot run python3: {err}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to python3");
    let output = child.wait_with_output().expect("python3 output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stderr.contains("No module named") {
        panic!("{stderr}\nprometheus-client is missing: install it with `bash scripts/deploy-deps.sh` (pip install prometheus-client)");
    }
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(stderr.into_owned())
    }
}

/// Polls until `/readyz` answers 200 (the bridge has Redis and its AMQP topology).
async fn wait_ready(base: &str) {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + 20 * SECOND;
    loop {
        if let Ok(response) = client.get(format!("{base}/readyz")).send().await {
            if response.status() == 200 {
                return;
            }
        }
        assert!(Instant::now() < deadline, "bridge not ready within 20 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_negotiate_pass_promtool_and_follow_what_topics_hold() {
    let mut config = test_config("metrics");
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{}", free_port());
    let base = format!("http://{}", config.http.listen);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    wait_ready(&base).await;

    // Plain scrapers (no Accept, curl's */*, promtool's text/plain) get the classic format.
    for accept in [None, Some("*/*"), Some("text/plain;version=0.0.4")] {
        let (content_type, text) = scrape(&base, accept).await;
        assert_eq!(content_type, CLASSIC, "Accept {accept:?}");
        assert!(!text.contains("# EOF"), "{text}");
    }
    let (_, classic) = scrape(&base, Some("text/plain")).await;
    let (clean, printed) = promtool_check_metrics(&classic);
    assert!(
        clean && printed.trim().is_empty(),
        "promtool: {printed}\n{classic}"
    );
    for line in [
        "# HELP redisched_publish_retries_total Publishes to retry later, by reason.",
        "# TYPE redisched_publish_retries_total counter",
        "redisched_publish_retries_total{reason=\"nack\"} 0",
        "redisched_jobs_dispatched_total 0",
        "# TYPE redisched_jobs_parked gauge",
        "# TYPE redisched_jobs_failing gauge",
        "# TYPE redisched_topic_paused gauge",
    ] {
        assert!(
            classic.lines().any(|l| l == line),
            "missing {line:?} in\n{classic}"
        );
    }

    // Prometheus asks for OpenMetrics first.
    let prometheus_accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    for accept in ["application/openmetrics-text", prometheus_accept] {
        let (content_type, text) = scrape(&base, Some(accept)).await;
        assert_eq!(content_type, OPEN_METRICS, "Accept {accept:?}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(
            text.contains("# TYPE redisched_publish_retries counter\n"),
            "{text}"
        );
        assert!(
            text.contains("redisched_publish_retries_total{reason=\"nack\"} 0\n"),
            "{text}"
        );
        let families = parse_open_metrics(&text)
            .unwrap_or_else(|err| panic!("not OpenMetrics: {err}\n{text}"));
        for family in [
            "redisched_publish_retries counter 3",
            "redisched_dispatch_lateness_seconds histogram",
            "redisched_jobs_parked gauge 0",
        ] {
            assert!(families.contains(family), "{family:?} not in\n{families}");
        }
    }
    // The parser is strict: the classic text is not OpenMetrics.
    assert!(parse_open_metrics(&classic).is_err());

    // A topic with a job waiting has its series; once the job is delivered it has none.
    let topic = "metrics.drained";
    let series = format!("redisched_jobs_scheduled{{topic=\"{topic}\"}} 1");
    let mut ready = broker.consume_ready(topic).await;
    broker
        .put(
            topic,
            "m-1",
            b"x",
            &[("x-delay", AMQPValue::LongInt(1_500))],
        )
        .await;
    let deadline = Instant::now() + 10 * SECOND;
    loop {
        let (_, text) = scrape(&base, None).await;
        if text.lines().any(|l| l == series) {
            assert!(
                text.contains(&format!("redisched_jobs_parked{{topic=\"{topic}\"}} 0\n")),
                "{text}"
            );
            let (clean, printed) = promtool_check_metrics(&text);
            assert!(
                clean && printed.trim().is_empty(),
                "promtool: {printed}\n{text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no {series:?} in\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ready.next(10 * SECOND).await.expect("job delivered");
    let deadline = Instant::now() + 10 * SECOND;
    loop {
        let (_, text) = scrape(&base, None).await;
        if !text.contains(&format!("topic=\"{topic}\"")) {
            assert!(
                text.contains("redisched_jobs_dispatched_total 1\n"),
                "{text}"
            );
            assert!(
                text.contains("# TYPE redisched_jobs_scheduled gauge\n"),
                "{text}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the drained topic keeps its series:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    bridge.stop().await;
    broker.cleanup().await;
}

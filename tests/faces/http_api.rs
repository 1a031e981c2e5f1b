//! The HTTP admin API against a real Redis: every endpoint, auth, errors, the event
//! stream, the compatibility layer and the OpenAPI document.

use crate::common;

use std::time::Duration;

use redisched::config::Config;
use redisched::feed::Event;
use redisched::http::AppState;
use redisched::store::{ConnectOptions, Limits, Store};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// A running server over a store of its own; shut down and cleaned up on drop.
struct Server {
    base: String,
    client: reqwest::Client,
    state: AppState,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    _store: Option<common::TestStore>,
}

impl Server {
    async fn start(token: &str, limits: Limits) -> Self {
        let store = common::test_store_with(limits).await;
        let mut server = Self::start_with(store.store.clone(), token).await;
        server._store = Some(store);
        server
    }

    async fn start_with(store: Store, token: &str) -> Self {
        let mut config = Config::default();
        config.http.token = token.to_string();
        Self::start_configured(store, config).await
    }

    /// A server with `http` settings of its own (tokens).
    async fn start_http(http: redisched::config::HttpConfig) -> Self {
        let store = common::test_store_with(LIMITS).await;
        let config = Config {
            http,
            ..Config::default()
        };
        let mut server = Self::start_configured(store.store.clone(), config).await;
        server._store = Some(store);
        server
    }

    async fn start_configured(store: Store, config: Config) -> Self {
        let common::api::Served {
            base,
            client,
            state,
            shutdown,
            task,
        } = common::api::serve(store, config).await;
        Self {
            base,
            client,
            state,
            shutdown,
            task: Some(task),
            _store: None,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        let res = self.client.get(self.url(path)).send().await.expect("GET");
        let status = res.status();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let res = req.send().await.expect("request");
        let status = res.status();
        (status, res.json().await.unwrap_or(Value::Null))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

const LIMITS: Limits = common::DEFAULT_LIMITS;

#[tokio::test]
async fn health_readiness_and_metrics() {
    let s = Server::start("", LIMITS).await;
    let (status, body) = s.get("/healthz").await;
    assert_eq!((status, body), (StatusCode::OK, json!({"status": "ok"})));

    // Redis answers but no bridge declared the AMQP topology.
    let (status, body) = s.get("/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["ready"], false);
    assert_eq!(body["redis"], "ok");
    assert!(body["error"].as_str().unwrap().contains("amqp"), "{body}");
    s.state.metrics.set_topology_ready(true);
    let (status, body) = s.get("/readyz").await;
    assert_eq!(
        (status, &body["ready"]),
        (StatusCode::OK, &json!(true)),
        "{body}"
    );

    let put = s
        .client
        .put(s.url("/v1/topics/mails/jobs/a?delay_ms=60000"))
        .body("x");
    assert_eq!(s.send(put).await.0, StatusCode::CREATED);
    let put = s
        .client
        .put(s.url("/v1/topics/mails/jobs/b?delay_ms=-5"))
        .body("y");
    assert_eq!(s.send(put).await.0, StatusCode::CREATED);

    let res = s.client.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let content_type = res.headers()["content-type"].to_str().unwrap().to_string();
    // No Accept header: the classic text format (tests/faces/metrics.rs covers negotiation).
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let text = res.text().await.unwrap();
    for line in [
        "redisched_jobs_scheduled{topic=\"mails\"} 2",
        "redisched_jobs_due{topic=\"mails\"} 1",
        "redisched_jobs_reserved{topic=\"mails\"} 0",
        "redisched_commands_total{op=\"put\",outcome=\"scheduled\"} 2",
        "# TYPE redisched_jobs_scheduled gauge",
        "# TYPE redisched_dispatch_lateness_seconds histogram",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    assert!(
        !text.contains("# EOF"),
        "classic text has no # EOF:\n{text}"
    );
}

#[tokio::test]
async fn rest_put_get_list_delete() {
    let s = Server::start("", LIMITS).await;
    let job = |id: &str, query: &str| s.url(&format!("/v1/topics/orders/jobs/{id}{query}"));

    let (status, body) = s
        .send(s.client.put(job("o-1", "?delay_ms=60000")).body("first"))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["status"], "scheduled");
    let due = body["due_at"].as_i64().unwrap();

    let (status, body) = s
        .send(s.client.put(job("o-1", "?delay_ms=1")).body("second"))
        .await;
    assert_eq!(
        (status, &body["status"]),
        (StatusCode::OK, &json!("duplicate"))
    );
    assert_eq!(
        body["due_at"].as_i64(),
        Some(due),
        "a duplicate keeps the stored job"
    );

    let (status, body) = s
        .send(
            s.client
                .put(job("o-1", "?delay_ms=120000&replace=true"))
                .body("third"),
        )
        .await;
    assert_eq!(
        (status, &body["status"]),
        (StatusCode::OK, &json!("replaced"))
    );
    let (status, body) = s
        .send(
            s.client
                .put(job("o-1", "?delay_ms=120000&mode=replace"))
                .body("fourth"),
        )
        .await;
    assert_eq!(
        (status, &body["status"]),
        (StatusCode::OK, &json!("replaced"))
    );

    let (status, body) = s.get("/v1/topics/orders/jobs/o-1").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["state"], "scheduled");
    assert_eq!(body["body"], "fourth");
    assert_eq!(body["encoding"], "utf-8");
    assert_eq!(body["attempts"], 0);
    assert!(body["due_at"].as_i64().unwrap() > due);

    // Binary bodies come back as base64; `at` takes epoch ms or RFC 3339.
    let now = s.state.store.server_time().await.unwrap();
    let at_ms = (now / 1000 + 10 * 86_400) * 1000; // ten days ahead, whole seconds
    let (status, _) = s
        .send(
            s.client
                .put(job("bin", &format!("?at={at_ms}")))
                .body(vec![0u8, 0xff, 7]),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, body) = s.get("/v1/topics/orders/jobs/bin").await;
    assert_eq!(
        (&body["body"], &body["encoding"]),
        (&json!("AP8H"), &json!("base64"))
    );
    assert_eq!(body["due_at"], at_ms);
    let at_text = humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + Duration::from_millis(at_ms as u64 + 1000),
    );
    let (status, body) = s
        .send(s.client.put(job("rfc", &format!("?at={at_text}"))))
        .await;
    assert_eq!(
        (status, &body["due_at"]),
        (StatusCode::CREATED, &json!(at_ms + 1000))
    );
    // A job id with a space and a slash, percent-encoded in the path.
    let (status, _) = s
        .send(s.client.put(job("a%20b%2Fc", "?delay_ms=30000")))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, body) = s.get("/v1/topics/orders/jobs/a%20b%2Fc").await;
    assert_eq!((status, &body["id"]), (StatusCode::OK, &json!("a b/c")));

    let (status, body) = s.get("/v1/topics/orders/jobs?limit=3").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let ids: Vec<&str> = body["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a b/c", "o-1", "bin"], "earliest first, limited");
    assert!(body["now"].as_i64().unwrap() > 0);
    // The same rows as `redisched list --json` (one view for both faces).
    assert_eq!(
        body["jobs"][0]["due_at_rfc3339"],
        redisched::view::rfc3339(body["jobs"][0]["due_at"].as_i64().unwrap())
    );

    let (status, body) = s.get("/v1/topics").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["topics"][0]["topic"], "orders");
    assert_eq!(body["topics"][0]["scheduled"], 4);
    assert_eq!(body["topics"][0]["due_now"], 0);

    let (status, body) = s.send(s.client.delete(job("o-1", ""))).await;
    assert_eq!((status, &body["deleted"]), (StatusCode::OK, &json!(true)));
    let (status, body) = s.send(s.client.delete(job("o-1", ""))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body["error"].as_str().unwrap().contains("o-1"), "{body}");
    // In the user's terms, not Rust's (`JobId("o-1")`).
    assert_eq!(body["error"], "no job o-1 in topic orders", "{body}");
    let (status, body) = s.get("/v1/topics/orders/jobs/o-1").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    let metrics = s.state.metrics.encode();
    assert!(
        metrics.contains("redisched_commands_total{op=\"replace\",outcome=\"replaced\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("redisched_commands_total{op=\"delete\",outcome=\"not_found\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn bad_requests_get_json_errors_with_the_right_status() {
    let limits = Limits {
        max_delay_ms: 3_600_000,
        max_body_bytes: 1024,
    };
    let s = Server::start("", limits).await;
    for (path, what) in [
        ("/v1/topics/a%20b/jobs/x", "topic"),
        ("/v1/topics/a%7Bb/jobs/x", "topic"),
        ("/v1/topics/t/jobs/x?delay_ms=soon", "delay_ms"),
        ("/v1/topics/t/jobs/x?delay_ms=1&at=2", "not both"),
        ("/v1/topics/t/jobs/x?at=tomorrow", "RFC 3339"),
        // One due-time check for every face (job.rs), in the user's terms.
        (
            "/v1/topics/t/jobs/x?delay_ms=12345678901234567",
            "delay_ms 12345678901234567 is out of range",
        ),
        (
            "/v1/topics/t/jobs/x?at=1969-07-20T20:17:00Z",
            "is before 1970",
        ),
        ("/v1/topics/t/jobs/x?mode=upsert", "mode"),
        ("/v1/topics/t/jobs/x?replace=maybe", "replace"),
        ("/v1/topics/t/jobs/a%0Ab", "job id"),
    ] {
        let (status, body) = s.send(s.client.put(s.url(path)).body("b")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
        let message = body["error"].as_str().unwrap_or_default();
        assert!(
            message.contains(what),
            "{path}: {message:?} should mention {what:?}"
        );
    }
    for path in [
        "/v1/topics/t/jobs?limit=0",
        "/v1/topics/t/jobs?limit=5000",
        "/v1/topics/t/jobs?offset=-1",
        "/v1/topics/a%20b/jobs",
    ] {
        let (status, body) = s.get(path).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
    }

    let (status, body) = s
        .send(
            s.client
                .put(s.url("/v1/topics/t/jobs/big"))
                .body(vec![b'x'; 2048]),
        )
        .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_eq!(body["code"], "body_too_large");
    let (status, _) = s
        .send(
            s.client
                .put(s.url("/v1/topics/t/jobs/fits"))
                .body(vec![b'x'; 1024]),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);

    // Refused by the put script itself: a delay over limits.max_delay_ms.
    let (status, body) = s
        .send(
            s.client
                .put(s.url("/v1/topics/t/jobs/far?delay_ms=7200000")),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["code"], "delay_too_long");

    let (status, body) = s.get("/no/such/thing").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body["error"].is_string());

    let metrics = s.state.metrics.encode();
    assert!(
        metrics.contains("redisched_commands_total{op=\"put\",outcome=\"invalid\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn mutations_need_the_bearer_token_when_one_is_set() {
    let s = Server::start("s3cret", LIMITS).await;
    let url = s.url("/v1/topics/t/jobs/x?delay_ms=60000");

    let res = s.client.put(&url).body("b").send().await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert!(res.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .starts_with("Bearer"));
    let body: Value = res.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("Bearer"), "{body}");

    let (status, _) = s
        .send(s.client.put(&url).bearer_auth("wrong").body("b"))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = s
        .send(
            s.client
                .put(&url)
                .header("authorization", "Basic czNjcmV0")
                .body("b"),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = s
        .send(s.client.put(&url).bearer_auth("s3cret").body("b"))
        .await;
    assert_eq!(status, StatusCode::CREATED);

    // Reads of job data are guarded too (see the read-token test); every mutation is.
    assert_eq!(
        s.get("/v1/topics/t/jobs/x").await.0,
        StatusCode::UNAUTHORIZED
    );
    let read = s
        .client
        .get(s.url("/v1/topics/t/jobs/x"))
        .bearer_auth("s3cret");
    assert_eq!(s.send(read).await.0, StatusCode::OK);
    let del = s.client.delete(s.url("/v1/topics/t/jobs/x"));
    assert_eq!(s.send(del).await.0, StatusCode::UNAUTHORIZED);
    let schedule = s
        .client
        .post(s.url("/schedule/t"))
        .json(&json!({"id": "y"}));
    assert_eq!(s.send(schedule).await.0, StatusCode::UNAUTHORIZED);
    let cancel = s.client.post(s.url("/cancel/t")).json(&json!({"id": "x"}));
    assert_eq!(s.send(cancel).await.0, StatusCode::UNAUTHORIZED);
    let read = s
        .client
        .get(s.url("/v1/topics/t/jobs/x"))
        .bearer_auth("s3cret");
    assert_eq!(s.send(read).await.0, StatusCode::OK, "still there");
    let del = s
        .client
        .delete(s.url("/v1/topics/t/jobs/x"))
        .bearer_auth("s3cret");
    assert_eq!(s.send(del).await.0, StatusCode::OK);
}

/// With a token configured, nothing that shows job data is open: every read endpoint
/// wants `http.token` or `http.read_token`; the read token changes nothing; health stays
/// open; `/metrics` is open until `http.metrics_token` is set.
#[tokio::test]
async fn reads_need_a_token_and_the_read_token_only_reads() {
    let s = Server::start_http(redisched::config::HttpConfig {
        token: "full-token".into(),
        read_token: "read-token".into(),
        ..Default::default()
    })
    .await;
    let put = s
        .client
        .put(s.url("/v1/topics/t/jobs/secret?delay_ms=60000"))
        .bearer_auth("full-token")
        .body("an address, say");
    assert_eq!(s.send(put).await.0, StatusCode::CREATED);

    let reads = [
        "/v1/topics",
        "/v1/topics/t/jobs",
        "/v1/topics/t/jobs/secret",
        "/v1/events",
    ];
    for path in reads {
        let res = s.client.get(s.url(path)).send().await.unwrap();
        assert_eq!(
            res.status(),
            StatusCode::UNAUTHORIZED,
            "{path} without a token"
        );
        let body: Value = res.json().await.unwrap();
        assert!(!body.to_string().contains("an address"), "{path}: {body}");
        let wrong = s.client.get(s.url(path)).bearer_auth("guess");
        assert_eq!(s.send(wrong).await.0, StatusCode::UNAUTHORIZED, "{path}");
        for token in ["read-token", "full-token"] {
            let res = s
                .client
                .get(s.url(path))
                .bearer_auth(token)
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::OK, "{path} with {token}");
        }
    }
    // The browser's EventSource cannot send headers: access_token works for GET.
    let res = s
        .client
        .get(s.url("/v1/events?access_token=read-token"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let (status, body) = s
        .get("/v1/topics/t/jobs/secret?access_token=read-token")
        .await;
    assert_eq!(
        (status, body["body"].as_str()),
        (StatusCode::OK, Some("an address, say"))
    );

    // The read token changes nothing: 403, and the job is untouched.
    let writes = [
        s.client.put(s.url("/v1/topics/t/jobs/other")).body("x"),
        s.client.delete(s.url("/v1/topics/t/jobs/secret")),
        s.client
            .post(s.url("/schedule/t"))
            .json(&json!({"id": "y"})),
        s.client
            .post(s.url("/cancel/t"))
            .json(&json!({"id": "secret"})),
    ];
    for write in writes {
        let (status, body) = s.send(write.bearer_auth("read-token")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(
            body["error"].as_str().unwrap().contains("only read"),
            "{body}"
        );
    }
    let delete = s
        .client
        .delete(s.url("/v1/topics/t/jobs/secret?access_token=full-token"));
    assert_eq!(
        s.send(delete).await.0,
        StatusCode::UNAUTHORIZED,
        "no query token for writes"
    );
    let read = s
        .client
        .get(s.url("/v1/topics/t/jobs/secret"))
        .bearer_auth("read-token");
    assert_eq!(s.send(read).await.0, StatusCode::OK, "still there");

    // Open: health, readiness (503 here, but answered), the API document, the dashboard page.
    for path in ["/healthz", "/readyz", "/v1/openapi.json", "/", "/metrics"] {
        let status = s.client.get(s.url(path)).send().await.unwrap().status();
        assert_ne!(status, StatusCode::UNAUTHORIZED, "{path} stays open");
    }

    // A metrics token closes /metrics; the other tokens open it too.
    let m = Server::start_http(redisched::config::HttpConfig {
        token: "full-token".into(),
        read_token: "read-token".into(),
        metrics_token: "scrape-token".into(),
        ..Default::default()
    })
    .await;
    let res = m.client.get(m.url("/metrics")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    for token in ["scrape-token", "read-token", "full-token"] {
        let res = m
            .client
            .get(m.url("/metrics"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{token}");
    }
    let res = m
        .client
        .get(m.url("/v1/topics"))
        .bearer_auth("scrape-token")
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        StatusCode::FORBIDDEN,
        "the metrics token reads no jobs"
    );
}

#[tokio::test]
async fn the_original_schedule_and_cancel_endpoints_work() {
    let s = Server::start("", LIMITS).await;
    let before = s.state.store.server_time().await.unwrap();
    let req = s
        .client
        .post(s.url("/schedule/legacy"))
        .json(&json!({"id": "j1", "contents": "hello", "delay": 1.5}));
    let (status, body) = s.send(req).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["status"], "scheduled");
    let due = body["due_at"].as_i64().unwrap();
    assert!(
        (before + 1500..before + 3000).contains(&due),
        "due {due}, before {before}"
    );

    let (_, job) = s.get("/v1/topics/legacy/jobs/j1").await;
    assert_eq!(job["body"], "hello");

    // Non-string contents are stored as their JSON text; numeric ids and delays as strings work.
    let req = s
        .client
        .post(s.url("/schedule/legacy"))
        .json(&json!({"id": 42, "contents": {"a": 1}, "delay": "60"}));
    assert_eq!(s.send(req).await.0, StatusCode::CREATED);
    let (_, job) = s.get("/v1/topics/legacy/jobs/42").await;
    assert_eq!(job["body"], "{\"a\":1}");
    let req = s
        .client
        .post(s.url("/schedule/legacy"))
        .json(&json!({"id": "j1", "contents": "again"}));
    assert_eq!(s.send(req).await.1["status"], "duplicate");

    let req = s
        .client
        .post(s.url("/cancel/legacy"))
        .json(&json!({"id": "j1"}));
    let (status, body) = s.send(req).await;
    assert_eq!((status, &body["deleted"]), (StatusCode::OK, &json!(true)));
    let req = s
        .client
        .post(s.url("/cancel/legacy"))
        .json(&json!({"id": "j1"}));
    assert_eq!(s.send(req).await.0, StatusCode::NOT_FOUND);

    for bad in [
        s.client
            .post(s.url("/schedule/legacy"))
            .header("content-type", "application/json")
            .body("{not json"),
        s.client
            .post(s.url("/schedule/legacy"))
            .json(&json!({"contents": "no id"})),
        s.client
            .post(s.url("/schedule/legacy"))
            .json(&json!({"id": "d", "delay": "later"})),
        s.client
            .post(s.url("/schedule/bad%20topic"))
            .json(&json!({"id": "d"})),
        s.client.post(s.url("/cancel/legacy")).json(&json!({})),
    ] {
        let (status, body) = s.send(bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert!(body["error"].is_string());
    }
    let wrong_type = s
        .client
        .post(s.url("/schedule/legacy"))
        .header("content-type", "text/plain")
        .body("{}");
    assert_eq!(
        s.send(wrong_type).await.0,
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );
}

/// Reads server-sent events until `want` of them arrived (or 10 s passed).
async fn read_events(res: &mut reqwest::Response, want: usize) -> Vec<Value> {
    let mut events = Vec::new();
    let mut buffer = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while events.len() < want {
        let chunk = tokio::time::timeout_at(deadline, res.chunk())
            .await
            .expect("events in time")
            .expect("stream readable")
            .expect("stream open");
        buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            for line in frame.lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    events.push(serde_json::from_str(data.trim()).expect("event JSON"));
                }
            }
        }
    }
    events
}

#[tokio::test]
async fn events_stream_feed_events_as_server_sent_events() {
    let s = Server::start("", LIMITS).await;
    let mut res = s.client.get(s.url("/v1/events")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    // The subscription exists once the response headers are in.
    s.state.feed.send(Event::Dispatched {
        topic: "t".into(),
        id: "d1".into(),
        due_at: 1000,
        attempt: 1,
        at: 1003,
        lateness_ms: 3,
    });
    let (status, _) = s.send(s.client.put(s.url("/v1/topics/t/jobs/c1"))).await;
    assert_eq!(status, StatusCode::CREATED);
    let events = read_events(&mut res, 2).await;
    assert_eq!(
        events[0],
        json!({"kind": "dispatched", "topic": "t", "id": "d1", "due_at": 1000, "attempt": 1, "at": 1003, "lateness_ms": 3})
    );
    assert_eq!(
        events[1],
        json!({"kind": "command", "topic": "t", "id": "c1", "op": "put", "outcome": "scheduled"})
    );

    // Shutdown ends the stream, and `serve` returns.
    s.shutdown.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = res.chunk().await {}
    })
    .await;
    assert!(ended.is_ok(), "the event stream ends on shutdown");
    let mut s = s;
    let task = s.task.take().unwrap();
    let result = tokio::time::timeout(Duration::from_secs(5), task).await;
    assert!(
        matches!(result, Ok(Ok(Ok(())))),
        "serve returns Ok after shutdown: {result:?}"
    );
}

#[tokio::test]
async fn the_openapi_document_covers_every_route() {
    let s = Server::start("", LIMITS).await;
    let (status, doc) = s.get("/v1/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    for (path, methods) in [
        ("/healthz", &["get"][..]),
        ("/readyz", &["get"]),
        ("/metrics", &["get"]),
        ("/v1/events", &["get"]),
        ("/v1/openapi.json", &["get"]),
        ("/v1/topics", &["get"]),
        ("/v1/topics/{topic}/jobs", &["get"]),
        ("/v1/topics/{topic}/jobs/{id}", &["get", "put", "delete"]),
        ("/schedule/{topic}", &["post"]),
        ("/cancel/{topic}", &["post"]),
    ] {
        for method in methods {
            assert!(
                paths[path][method].is_object(),
                "{method} {path} is documented"
            );
        }
    }
    // Every $ref points at something that exists.
    let text = doc.to_string();
    for part in text.split("\"$ref\":\"#/").skip(1) {
        let pointer = format!("/{}", &part[..part.find('"').unwrap()]);
        assert!(doc.pointer(&pointer).is_some(), "dangling $ref {pointer}");
    }

    let res = s.client.get(s.url("/")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let page = res.text().await.unwrap();
    assert!(page.contains("EventSource(\"/v1/events\""));
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "no external assets"
    );
}

/// A TCP relay to Redis that can be cut, to see how the API behaves when Redis goes away.
struct Relay {
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(target: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut pipes = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                pipes.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Self { addr, task }
    }

    /// Closes the listener and every relayed connection (the JoinSet aborts on drop).
    fn cut(&self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn redis_going_away_gives_503_not_a_hang() {
    let url = url::Url::parse(&common::redis_url()).unwrap();
    let target = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(6379));
    let relay = Relay::start(target).await;
    let prefix = common::unique("http503");
    let options = ConnectOptions {
        url: format!(
            "redis://{}/{}",
            relay.addr,
            url.path().trim_start_matches('/')
        ),
        prefix: prefix.clone(),
        connect_timeout: Duration::from_millis(500),
        response_timeout: Duration::from_millis(1000),
        tls_ca_file: None,
    };
    let store = Store::connect(&options, LIMITS)
        .await
        .expect("connect through the relay");
    let s = Server::start_with(store, "").await;
    s.state.metrics.set_topology_ready(true);
    assert_eq!(s.get("/readyz").await.0, StatusCode::OK);

    relay.cut();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, body) = s.get("/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_ne!(body["redis"], "ok");
    let (status, body) = s.send(s.client.put(s.url("/v1/topics/t/jobs/x"))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("unavailable"),
        "{body}"
    );
    let (status, _) = s.get("/v1/topics").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    // Metrics still answer, without the per-topic gauges.
    let res = s.client.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(!res
        .text()
        .await
        .unwrap()
        .contains("redisched_jobs_scheduled{"));
    common::delete_prefix(&prefix);
}

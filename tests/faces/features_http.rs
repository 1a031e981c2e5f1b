//! The scheduler features through the REST API against a real Redis (and
//! RabbitMQ where a bridge dispatches): pause and resume with another topic flowing,
//! failing and parked jobs with redrive, the outcome history, recurring puts, the
//! per-topic gauges, auth on the new endpoints, and the same JSON as the CLI's `--json`.

use crate::common;

use std::time::Duration;

use clap::Parser;
use redisched::config::{Config, HttpConfig};
use redisched::job::Topic;
use redisched::store::{Lease, RetryOutcome, Store};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// A server over a store on `prefix`; shut down on drop (the keys are the caller's).
pub(crate) struct Server {
    base: String,
    client: reqwest::Client,
    store: Store,
    shutdown: CancellationToken,
}

impl Server {
    pub(crate) async fn start(prefix: &str, http: HttpConfig) -> Self {
        let store = common::test_store_named(prefix).await;
        let config = Config {
            http,
            ..Config::default()
        };
        let common::api::Served {
            base,
            client,
            shutdown,
            ..
        } = common::api::serve(store.clone(), config).await;
        Self {
            base,
            client,
            store,
            shutdown,
        }
    }

    async fn call(&self, method: Method, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        let mut request = self.client.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let res = request.send().await.expect("request");
        let status = res.status();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    pub(crate) async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    pub(crate) async fn post(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::POST, path, None).await
    }

    async fn put(&self, path: &str, body: &str) -> (StatusCode, Value) {
        let res = self
            .client
            .put(format!("{}{path}", self.base))
            .body(body.to_string())
            .send()
            .await
            .expect("PUT");
        let status = res.status();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    pub(crate) async fn metrics(&self) -> String {
        let res = self
            .client
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("GET /metrics");
        res.text().await.expect("metrics text")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A server over a store of its own prefix, deleted on drop.
struct Isolated {
    server: Server,
    prefix: String,
}

impl Isolated {
    async fn start(http: HttpConfig) -> Self {
        let prefix = common::unique("fhttp");
        Self {
            server: Server::start(&prefix, http).await,
            prefix,
        }
    }
}

impl std::ops::Deref for Isolated {
    type Target = Server;
    fn deref(&self) -> &Server {
        &self.server
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        common::delete_prefix(&self.prefix);
    }
}

fn topic(name: &str) -> Topic {
    Topic::new(name).unwrap()
}

fn ids_of(rows: &Value) -> Vec<String> {
    rows.as_array()
        .unwrap_or_else(|| panic!("not an array: {rows}"))
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect()
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

/// Records a failed publish of a reserved job, as the dispatcher does.
async fn fail(store: &Store, leases: &[Lease], id: &str, max_attempts: u32) -> RetryOutcome {
    let lease = leases.iter().find(|lease| lease.id == id).unwrap();
    store
        .retry_failed(lease, Duration::ZERO, "unroutable: NO_ROUTE", max_attempts)
        .await
        .unwrap()
}

#[tokio::test]
async fn failing_and_parked_jobs_show_and_redrive_over_rest() {
    let s = Isolated::start(HttpConfig::default()).await;
    for id in ["p1", "p2", "f1", "ok"] {
        let (status, _) = s
            .put(&format!("/v1/topics/jobs/jobs/{id}"), "payload")
            .await;
        assert_eq!(status, StatusCode::CREATED);
    }
    // Two dispatch rounds: p1 parks at its second failure (max_attempts 2), p2 at its
    // first (1), f1 keeps failing (0 = retry forever), ok never fails.
    let leases = reserve_all(&s.store, "jobs").await;
    assert_eq!(leases.len(), 4);
    assert_eq!(
        fail(&s.store, &leases, "p1", 2).await,
        RetryOutcome::Retried
    );
    assert_eq!(fail(&s.store, &leases, "p2", 1).await, RetryOutcome::Parked);
    assert_eq!(
        fail(&s.store, &leases, "f1", 0).await,
        RetryOutcome::Retried
    );
    let ok = leases.iter().find(|lease| lease.id == "ok").unwrap();
    assert!(s.store.retry(ok, Duration::ZERO).await.unwrap());
    let leases = reserve_all(&s.store, "jobs").await;
    assert_eq!(leases.len(), 3);
    assert_eq!(fail(&s.store, &leases, "p1", 2).await, RetryOutcome::Parked);
    assert_eq!(
        fail(&s.store, &leases, "f1", 0).await,
        RetryOutcome::Retried
    );
    let ok = leases.iter().find(|lease| lease.id == "ok").unwrap();
    assert!(s.store.retry(ok, Duration::ZERO).await.unwrap());

    let (status, job) = s.get("/v1/topics/jobs/jobs/p1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(job["state"], "parked", "{job}");
    assert_eq!(job["failures"], 2);
    assert_eq!(job["last_error"], "unroutable: NO_ROUTE");
    let at = job["last_error_at"].as_i64().unwrap();
    assert_eq!(
        job["last_error_at_rfc3339"],
        redisched::view::rfc3339(at),
        "{job}"
    );
    assert_eq!(job["body"], "payload");
    let (_, fine) = s.get("/v1/topics/jobs/jobs/ok").await;
    assert_eq!(
        (&fine["last_error"], &fine["last_error_at"]),
        (&Value::Null, &Value::Null)
    );

    let (_, waiting) = s.get("/v1/topics/jobs/jobs").await;
    let mut ids = ids_of(&waiting["jobs"]);
    ids.sort();
    assert_eq!(ids, ["f1", "ok"], "{waiting}");
    let f1 = waiting["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == "f1")
        .unwrap();
    assert_eq!(f1["last_error"], "unroutable: NO_ROUTE");
    let (_, parked) = s.get("/v1/topics/jobs/jobs?state=parked").await;
    assert_eq!(ids_of(&parked["jobs"]), ["p1", "p2"]);
    assert_eq!(parked["jobs"][0]["state"], "parked");
    let (status, body) = s.get("/v1/topics/jobs/jobs?state=dead").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    let (_, topics) = s.get("/v1/topics").await;
    let row = &topics["topics"][0];
    assert_eq!(
        (&row["parked"], &row["failing"], &row["scheduled"]),
        (&json!(2), &json!(3), &json!(2)),
        "{row}"
    );
    let text = s.metrics().await;
    for series in [
        "redisched_jobs_parked{topic=\"jobs\"} 2\n",
        "redisched_jobs_failing{topic=\"jobs\"} 3\n",
        "redisched_topic_paused{topic=\"jobs\"} 0\n",
    ] {
        assert!(text.contains(series), "missing {series}: {text}");
    }

    let (status, body) = s.post("/v1/topics/jobs/jobs/p1/redrive").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({"topic": "jobs", "id": "p1", "redriven": 1}));
    let (_, job) = s.get("/v1/topics/jobs/jobs/p1").await;
    assert_eq!(job["state"], "scheduled");
    let now = s.store.server_time().await.unwrap();
    assert!(job["due_at"].as_i64().unwrap() <= now, "due now: {job}");
    assert_eq!(job["attempts"], 2, "attempts kept: {job}");
    let (status, body) = s.post("/v1/topics/jobs/jobs/p1/redrive").await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("is not parked"),
        "{body}"
    );
    let (status, body) = s.post("/v1/topics/jobs/jobs/nope/redrive").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    let (status, body) = s.post("/v1/topics/jobs/redrive").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({"topic": "jobs", "redriven": 1}));
    let (_, body) = s.post("/v1/topics/jobs/redrive").await;
    assert_eq!(body["redriven"], 0);
    let (_, parked) = s.get("/v1/topics/jobs/jobs?state=parked").await;
    assert_eq!(parked["jobs"], json!([]));
    // Deleting a parked job works like deleting any job.
    let leases = reserve_all(&s.store, "jobs").await;
    assert_eq!(fail(&s.store, &leases, "p2", 1).await, RetryOutcome::Parked);
    let res = s
        .client
        .delete(format!("{}/v1/topics/jobs/jobs/p2", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        s.get("/v1/topics/jobs/jobs/p2").await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn history_over_rest_lists_dispatched_and_deleted_outcomes() {
    let s = Isolated::start(HttpConfig::default()).await;
    let (status, empty) = s.get("/v1/topics/h/history").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(empty, json!({"topic": "h", "entries": []}));

    assert_eq!(
        s.put("/v1/topics/h/jobs/sent", "x").await.0,
        StatusCode::CREATED
    );
    let leases = reserve_all(&s.store, "h").await;
    assert_eq!(s.store.release(&leases).await.unwrap(), 1);
    assert_eq!(
        s.put("/v1/topics/h/jobs/gone?delay_ms=60000", "y").await.0,
        StatusCode::CREATED
    );
    let res = s
        .client
        .delete(format!("{}/v1/topics/h/jobs/gone", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    let (_, history) = s.get("/v1/topics/h/history").await;
    let entries = history["entries"].as_array().unwrap();
    let outcomes: Vec<(&str, &str)> = entries
        .iter()
        .map(|e| (e["outcome"].as_str().unwrap(), e["id"].as_str().unwrap()))
        .collect();
    assert_eq!(
        outcomes,
        [("deleted", "gone"), ("dispatched", "sent")],
        "{history}"
    );
    assert_eq!(entries[1]["attempts"], 1);
    assert_eq!(
        entries[1]["at_rfc3339"],
        redisched::view::rfc3339(entries[1]["at"].as_i64().unwrap())
    );

    let (_, one) = s.get("/v1/topics/h/history?id=sent").await;
    assert_eq!(one["id"], "sent");
    assert_eq!(one["entries"].as_array().unwrap().len(), 1);
    let (_, limited) = s.get("/v1/topics/h/history?limit=1").await;
    assert_eq!(ids_of(&limited["entries"]), ["gone"]);
    for bad in [
        "limit=0",
        "limit=1001",
        "limit=x",
        "limit=",
        "limit=%2B5",
        "id=a%07b",
        "id=",
    ] {
        let (status, body) = s.get(&format!("/v1/topics/h/history?{bad}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }
    // A job no longer stored is still 404, its history stays readable.
    assert_eq!(
        s.get("/v1/topics/h/jobs/sent").await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn recurring_puts_over_rest() {
    let s = Isolated::start(HttpConfig::default()).await;
    let before = s.store.server_time().await.unwrap();
    let (status, put) = s.put("/v1/topics/r/jobs/tick?every=15m", "t").await;
    let after = s.store.server_time().await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "{put}");
    let due = put["due_at"].as_i64().unwrap();
    assert!((before + 900_000..=after + 900_000).contains(&due), "{put}");
    let (_, job) = s.get("/v1/topics/r/jobs/tick").await;
    assert_eq!(job["every_ms"], 900_000, "{job}");
    assert!(
        job.get("cron").is_none() && job.get("tz").is_none(),
        "{job}"
    );

    let (status, _) = s
        .put("/v1/topics/r/jobs/ms?every=900000&delay_ms=0", "")
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, job) = s.get("/v1/topics/r/jobs/ms").await;
    assert_eq!(job["every_ms"], 900_000);
    let now = s.store.server_time().await.unwrap();
    assert!(
        job["due_at"].as_i64().unwrap() <= now,
        "delay_ms=0: first now: {job}"
    );

    // First match at or after `at` (a month ahead, midnight UTC): a weekday, 09:00 in
    // Berlin.
    let start = (now / 86_400_000 + 30) * 86_400_000;
    let (status, put) = s
        .put(
            &format!("/v1/topics/r/jobs/standup?cron=0%209%20*%20*%20MON-FRI&tz=Europe/Berlin&at={start}"),
            "",
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{put}");
    let due = put["due_at"].as_i64().unwrap();
    {
        use chrono::{Datelike, TimeZone, Timelike, Weekday};
        let local = chrono_tz::Europe::Berlin.timestamp_millis_opt(due).unwrap();
        assert_eq!((local.hour(), local.minute()), (9, 0), "{local}");
        assert!(
            !matches!(local.weekday(), Weekday::Sat | Weekday::Sun),
            "{local}"
        );
        assert!(due >= start && due - start < 4 * 86_400_000, "{local}");
    }
    let (_, job) = s.get("/v1/topics/r/jobs/standup").await;
    assert_eq!(
        (&job["cron"], &job["tz"]),
        (&json!("0 9 * * MON-FRI"), &json!("Europe/Berlin"))
    );
    assert!(job.get("every_ms").is_none(), "{job}");
    // A six-field expression (seconds) in UTC by default, from delay_ms: the first
    // even second at or after it.
    let (status, put) = s
        .put(
            "/v1/topics/r/jobs/even?cron=*/2%20*%20*%20*%20*%20*&delay_ms=10000",
            "",
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{put}");
    let due = put["due_at"].as_i64().unwrap();
    assert_eq!(due % 2000, 0, "{put}");
    let (_, job) = s.get("/v1/topics/r/jobs/even").await;
    assert_eq!(job["tz"], "UTC");

    // Replace changes the spec.
    let (status, _) = s
        .put(
            "/v1/topics/r/jobs/tick?mode=replace&cron=0%200%20*%20*%20*",
            "",
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, job) = s.get("/v1/topics/r/jobs/tick").await;
    assert_eq!(job["cron"], "0 0 * * *");
    assert!(job.get("every_ms").is_none(), "{job}");

    // Outside the form the document states: 400; in that form but unusable: 422
    // `invalid_schedule` (no schema can state a minimum interval or the zone list).
    let bad = StatusCode::BAD_REQUEST;
    let unusable = StatusCode::UNPROCESSABLE_ENTITY;
    for (query, want, reason) in [
        ("every=10", unusable, "below the minimum of 1000 ms"),
        ("every=soon", bad, "every: interval \"soon\""),
        ("every=15%20m", bad, "neither milliseconds nor a duration"),
        ("every=0", unusable, "positive"),
        ("cron=0%209%20*%20*", bad, "expected 5"),
        ("cron=0%2099%20*%20*%20*", unusable, "cron: cron expression"),
        ("cron=0%200%2030%202%20*", unusable, "never fires"),
        (
            "cron=0%209%20*%20*%20*&tz=Mars/Olympus",
            unusable,
            "unknown time zone",
        ),
        (
            "cron=0%209%20*%20*%20*&tz=Europe%20Berlin",
            bad,
            "not an IANA time zone name",
        ),
        ("every=1m&cron=*%20*%20*%20*%20*", bad, "not both"),
        ("tz=UTC", bad, "only meaningful with cron"),
        ("every=", bad, "every must not be empty"),
        ("every=1m&tz=UTC", bad, "only meaningful with cron"),
    ] {
        let (status, body) = s.put(&format!("/v1/topics/r/jobs/bad?{query}"), "").await;
        assert_eq!(status, want, "{query}: {body}");
        let error = body["error"].as_str().unwrap();
        assert!(error.contains(reason), "{query}: {error}");
        if want == unusable {
            assert_eq!(body["code"], "invalid_schedule", "{query}: {body}");
        }
    }
    assert_eq!(
        s.get("/v1/topics/r/jobs/bad").await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn new_endpoints_follow_the_token_policy() {
    let s = Isolated::start(HttpConfig {
        token: "write-token".into(),
        read_token: "read-token".into(),
        ..HttpConfig::default()
    })
    .await;
    let read = Some("read-token");
    let write = Some("write-token");
    for (method, path) in [
        (Method::POST, "/v1/topics/t/pause"),
        (Method::POST, "/v1/topics/t/resume"),
        (Method::POST, "/v1/topics/t/redrive"),
        (Method::POST, "/v1/topics/t/jobs/x/redrive"),
    ] {
        let (status, _) = s.call(method.clone(), path, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}");
        let (status, body) = s.call(method.clone(), path, read).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}: {body}");
    }
    assert_eq!(
        s.call(Method::GET, "/v1/topics/t/history", None).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        s.call(Method::GET, "/v1/topics/t/history", read).await.0,
        StatusCode::OK
    );
    assert_eq!(
        s.get("/v1/topics/t/history?access_token=read-token")
            .await
            .0,
        StatusCode::OK
    );
    // The read token paused nothing; the write token does.
    assert!(!s.store.is_paused(&topic("t")).await.unwrap());
    let (status, body) = s.call(Method::POST, "/v1/topics/t/pause", write).await;
    assert_eq!((status, &body["changed"]), (StatusCode::OK, &json!(true)));
    assert!(s.store.is_paused(&topic("t")).await.unwrap());
    let (status, _) = s.call(Method::POST, "/v1/topics/t/resume", write).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = s.call(Method::POST, "/v1/topics/t/redrive", write).await;
    assert_eq!(status, StatusCode::OK);
}

/// Runs `redisched <args> --json` on `prefix` in-process (as the binary's `main` does;
/// see tests/faces/features_cli.rs for why not the binary) and parses what it prints.
async fn cli_json(prefix: &str, args: &[&str]) -> Value {
    let config = std::env::temp_dir().join(format!("{}.toml", common::unique("fhttp-config")));
    let toml = format!(
        "[redis]\nurl = {:?}\nprefix = {:?}\n",
        common::redis_url(),
        prefix
    );
    std::fs::write(&config, toml).expect("write the test config");
    let config_arg = config.to_string_lossy().into_owned();
    let argv = ["redisched", "--json", "--config", config_arg.as_str()]
        .into_iter()
        .chain(args.iter().copied());
    let cli = redisched::cli::Cli::try_parse_from(argv).expect("parse");
    let result = redisched::cli::execute(&cli).await;
    let _ = std::fs::remove_file(&config);
    match result {
        Ok(output) => serde_json::from_str(&output.render(true)).expect("JSON output"),
        Err(err) => panic!("{args:?}: {err}"),
    }
}

#[tokio::test]
async fn the_cli_and_rest_answer_the_same_json() {
    let s = Isolated::start(HttpConfig::default()).await;
    s.put(
        "/v1/topics/same/jobs/cron?cron=0%209%20*%20*%20*&tz=Europe/Berlin",
        "c",
    )
    .await;
    s.put("/v1/topics/same/jobs/every?every=1h", "e").await;
    s.put("/v1/topics/same/jobs/parked", "p").await;
    s.put("/v1/topics/same/jobs/gone?delay_ms=60000", "g").await;
    let res = s
        .client
        .delete(format!("{}/v1/topics/same/jobs/gone", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let leases = reserve_all(&s.store, "same").await;
    assert_eq!(
        fail(&s.store, &leases, "parked", 1).await,
        RetryOutcome::Parked
    );
    s.post("/v1/topics/same/pause").await;
    let prefix = s.prefix.clone();

    for id in ["cron", "every", "parked"] {
        let (_, rest) = s.get(&format!("/v1/topics/same/jobs/{id}")).await;
        assert_eq!(
            cli_json(&prefix, &["get", "same", id]).await,
            rest,
            "get {id}"
        );
    }
    let (_, rest) = s.get("/v1/topics/same/history").await;
    assert_eq!(cli_json(&prefix, &["history", "same"]).await, rest);
    let (_, rest) = s.get("/v1/topics/same/history?id=parked&limit=5").await;
    assert_eq!(
        cli_json(&prefix, &["history", "same", "parked", "--limit", "5"]).await,
        rest
    );
    let (_, rest) = s.get("/v1/topics").await;
    assert_eq!(cli_json(&prefix, &["stats"]).await, rest);
    for (query, extra) in [("", None), ("?state=parked", Some("--parked"))] {
        let (_, mut rest) = s.get(&format!("/v1/topics/same/jobs{query}")).await;
        let mut args = vec!["list", "same"];
        args.extend(extra);
        let mut cli = cli_json(&prefix, &args).await;
        // The server's clock at the time of each read differs.
        rest["now"] = json!(0);
        cli["now"] = json!(0);
        assert_eq!(cli, rest, "list {query}");
    }
    let (_, rest) = s.post("/v1/topics/same/resume").await;
    assert_eq!(
        cli_json(&prefix, &["resume", "same"]).await,
        json!({"topic": "same", "paused": false, "changed": false})
    );
    assert_eq!(rest["changed"], true);
    let (_, rest) = s.post("/v1/topics/same/redrive").await;
    assert_eq!(rest["redriven"], 1);
    assert_eq!(
        cli_json(&prefix, &["redrive", "same"]).await,
        json!({"topic": "same", "redriven": 0})
    );
    let (_, doc) = s.get("/v1/openapi.json").await;
    for (path, method) in [
        ("/v1/topics/{topic}/pause", "post"),
        ("/v1/topics/{topic}/resume", "post"),
        ("/v1/topics/{topic}/redrive", "post"),
        ("/v1/topics/{topic}/jobs/{id}/redrive", "post"),
        ("/v1/topics/{topic}/history", "get"),
    ] {
        assert!(
            doc["paths"][path][method].is_object(),
            "{method} {path} is documented"
        );
    }
    let put_params: Vec<&str> = doc["paths"]["/v1/topics/{topic}/jobs/{id}"]["put"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        // A plain parameter, or a property of an exploded object (`every=…&cron=…`).
        .flat_map(|p| match p["schema"]["properties"].as_object() {
            Some(props) if p["explode"] == true => props.keys().map(String::as_str).collect(),
            _ => p["name"].as_str().into_iter().collect::<Vec<_>>(),
        })
        .collect();
    for name in ["every", "cron", "tz"] {
        assert!(put_params.contains(&name), "put documents {name}");
    }
}

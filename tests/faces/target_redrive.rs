//! Re-drive by target and time window through both faces against a real Redis:
//! `POST /v1/targets/{name}/redrive?since=&until=` and `redisched targets redrive <name>
//! --since --until`. Jobs parked at different times (their last failure recorded as the
//! dispatcher records it) in topics of two targets and of none: only the target's
//! topics' jobs whose last failure lies in the window come back, counted per topic.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use redisched::config::{Config, HttpConfig};
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{JobState, Lease, Outcome, PutRequest, RetryOutcome, Store};
use redisched::targets::TargetConfig;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

fn target(name: &str, topics: &[&str]) -> TargetConfig {
    TargetConfig {
        name: name.into(),
        topics: topics.iter().map(|t| t.to_string()).collect(),
        url: "http://127.0.0.1:9/hook".into(),
        ..TargetConfig::default()
    }
}

/// `billing` serves `billing.#`, `mail` serves `mail` and (listed after) nothing else.
fn targets() -> Vec<TargetConfig> {
    vec![target("billing", &["billing.#"]), target("mail", &["mail"])]
}

fn topic(name: &str) -> Topic {
    Topic::new(name).unwrap()
}

/// Puts `id` due now, reserves it and records a failed delivery with `max_attempts` 1,
/// as the dispatcher does: parked, its last failure at the server's now.
async fn park(store: &Store, topic_name: &str, id: &str) {
    let t = topic(topic_name);
    store
        .put(PutRequest {
            topic: t.clone(),
            id: JobId::new(id).unwrap(),
            body: b"payload".to_vec(),
            meta: Vec::new(),
            due: Due::NOW,
            mode: PutMode::Keep,
        })
        .await
        .unwrap();
    let batch = store
        .reserve(&t, Duration::from_secs(30), 10)
        .await
        .unwrap();
    let job = batch.jobs.iter().find(|j| j.id == id).expect("reserved");
    let lease = Lease {
        topic: t,
        id: id.to_string(),
        token: job.token,
    };
    let outcome = store
        .retry_failed(&lease, Duration::ZERO, "http 503", 1)
        .await
        .unwrap();
    assert_eq!(outcome, RetryOutcome::Parked);
}

/// The server's clock after a pause, so the parkings before and after differ from it.
async fn mark(store: &Store) -> i64 {
    tokio::time::sleep(Duration::from_millis(15)).await;
    let now = store.server_time().await.unwrap();
    tokio::time::sleep(Duration::from_millis(15)).await;
    now
}

/// Jobs parked before, inside and after a window, in topics of `billing`, of `mail`
/// and of no target; returns the window (epoch ms).
async fn park_around_a_window(store: &Store) -> (i64, i64) {
    park(store, "billing.eu", "old").await;
    let since = mark(store).await;
    park(store, "billing.eu", "eu-1").await;
    park(store, "billing.eu", "eu-2").await;
    park(store, "billing.us", "us-1").await;
    park(store, "mail", "mail-1").await;
    park(store, "other", "other-1").await;
    let until = mark(store).await;
    park(store, "billing.eu", "late").await;
    (since, until)
}

async fn state(store: &Store, topic_name: &str, id: &str) -> JobState {
    let id = JobId::new(id).unwrap();
    store
        .get(&topic(topic_name), &id)
        .await
        .unwrap()
        .unwrap()
        .state
}

/// The parked jobs outside `billing`'s window stay parked, the others are due now.
async fn assert_only_the_window_came_back(store: &Store) {
    for (t, id) in [
        ("billing.eu", "eu-1"),
        ("billing.eu", "eu-2"),
        ("billing.us", "us-1"),
    ] {
        assert_eq!(state(store, t, id).await, JobState::Scheduled, "{id}");
    }
    for (t, id) in [
        ("billing.eu", "old"),
        ("billing.eu", "late"),
        ("mail", "mail-1"),
        ("other", "other-1"),
    ] {
        assert_eq!(state(store, t, id).await, JobState::Parked, "{id}");
    }
    let history = store.history(&topic("billing.eu"), None, 10).await.unwrap();
    let redriven: Vec<&str> = history
        .iter()
        .filter(|h| h.outcome == Outcome::Redriven)
        .map(|h| h.id.as_str())
        .collect();
    assert_eq!(redriven, ["eu-2", "eu-1"], "logged in the topic's history");
}

struct Api {
    served: common::api::Served,
    prefix: String,
}

impl Api {
    async fn start(http: HttpConfig) -> Self {
        let prefix = common::unique("ftredrive");
        let store = common::test_store_named(&prefix).await;
        let config = Config {
            http,
            targets: targets(),
            ..Config::default()
        };
        config.validate().expect("a valid test config");
        Self {
            served: common::api::serve(store, config).await,
            prefix,
        }
    }

    fn store(&self) -> &Store {
        &self.served.state.store
    }

    async fn post(&self, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        let url = format!("{}{path}", self.served.base);
        let mut request = self.served.client.request(Method::POST, url);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let res = request.send().await.expect("POST");
        let status = res.status();
        (status, res.json().await.unwrap_or(Value::Null))
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        self.served.shutdown.cancel();
        common::delete_prefix(&self.prefix);
    }
}

#[tokio::test]
async fn rest_redrives_a_targets_parked_jobs_of_a_window_only() {
    let api = Api::start(HttpConfig::default()).await;
    let (since, until) = park_around_a_window(api.store()).await;

    // `since` as RFC 3339 with milliseconds, `until` as epoch ms.
    let since_text = redisched::view::rfc3339(since);
    let path = format!("/v1/targets/billing/redrive?since={since_text}&until={until}");
    let (status, body) = api.post(&path, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({
            "target": "billing",
            "since": since, "since_rfc3339": since_text,
            "until": until, "until_rfc3339": redisched::view::rfc3339(until),
            "redriven": 3,
            "topics": [
                {"topic": "billing.eu", "redriven": 2},
                {"topic": "billing.us", "redriven": 1},
            ],
        })
    );
    assert_only_the_window_came_back(api.store()).await;

    // A client's retry of the same request: nothing more.
    let (status, body) = api.post(&path, None).await;
    assert_eq!((status, &body["redriven"]), (StatusCode::OK, &json!(0)));

    // In the users' terms: unknown target, bad time, an empty window.
    let (status, body) = api.post("/v1/targets/biling/redrive", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        body["error"],
        "no webhook target named \"biling\" (configured: billing, mail)"
    );
    let (status, body) = api
        .post("/v1/targets/billing/redrive?since=yesterday", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let error = body["error"].as_str().unwrap();
    assert!(
        error.starts_with("since must be epoch milliseconds or an RFC 3339 time"),
        "{error}"
    );
    let (status, body) = api
        .post("/v1/targets/billing/redrive?since=2000&until=1000", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        body["error"],
        "since 2000 is after until 1000: no failure can fall in that window"
    );

    // No window: since 1970, until now: the two outside it.
    let (status, body) = api.post("/v1/targets/billing/redrive", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["redriven"], 2);
    assert_eq!(body["since"], 0);
    assert!(body["until"].as_i64().unwrap() > until);
    assert_eq!(
        state(api.store(), "billing.eu", "late").await,
        JobState::Scheduled
    );
    // The other target's topic, on its own.
    let (_, body) = api.post("/v1/targets/mail/redrive", None).await;
    assert_eq!(body["topics"], json!([{"topic": "mail", "redriven": 1}]));
    assert_eq!(
        state(api.store(), "other", "other-1").await,
        JobState::Parked
    );
}

#[tokio::test]
async fn rest_redrive_by_target_needs_the_write_token() {
    let api = Api::start(HttpConfig {
        token: "write-token".into(),
        read_token: "read-token".into(),
        ..HttpConfig::default()
    })
    .await;
    park(api.store(), "billing.eu", "p").await;
    let path = "/v1/targets/billing/redrive";
    assert_eq!(api.post(path, None).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(
        api.post(path, Some("read-token")).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        state(api.store(), "billing.eu", "p").await,
        JobState::Parked
    );
    let (status, body) = api.post(path, Some("write-token")).await;
    assert_eq!((status, &body["redriven"]), (StatusCode::OK, &json!(1)));
}

/// The `redisched` command line in-process (as the binary's `main` runs it; see
/// tests/faces/features_cli.rs for why not the binary) with a config file naming this
/// test's Redis, prefix and targets.
struct Cli {
    prefix: String,
    config: PathBuf,
}

impl Cli {
    fn new() -> Self {
        #[derive(serde::Serialize)]
        struct File {
            redis: Value,
            targets: Vec<TargetConfig>,
        }
        let prefix = common::unique("ftredrive-cli");
        let config = std::env::temp_dir().join(format!("{}.toml", common::unique("ftredrive")));
        let file = File {
            redis: json!({"url": common::redis_url(), "prefix": prefix}),
            targets: targets(),
        };
        std::fs::write(&config, toml::to_string(&file).unwrap()).expect("write the config");
        Self { prefix, config }
    }

    /// Exit code and what was printed (stdout on success, the error otherwise).
    async fn run(&self, args: &[&str]) -> (u8, String) {
        let config = self.config.to_string_lossy().into_owned();
        let argv = ["redisched", "--config", config.as_str()]
            .into_iter()
            .chain(args.iter().copied());
        let cli = match redisched::cli::Cli::try_parse_from(argv) {
            Ok(cli) => cli,
            Err(err) => {
                return (
                    u8::try_from(err.exit_code()).unwrap_or(255),
                    err.to_string(),
                )
            }
        };
        match redisched::cli::execute(&cli).await {
            Ok(output) => (0, output.render(cli.json)),
            Err(err) => (err.exit_code(), err.to_string()),
        }
    }

    async fn ok(&self, args: &[&str]) -> String {
        let (code, out) = self.run(args).await;
        assert_eq!(code, 0, "{args:?}: {out}");
        out
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
        common::delete_prefix(&self.prefix);
    }
}

#[tokio::test]
async fn the_cli_redrives_a_targets_parked_jobs_of_a_window_only() {
    let cli = Cli::new();
    let store = common::test_store_named(&cli.prefix).await;
    let (since, until) = park_around_a_window(&store).await;
    let since_text = redisched::view::rfc3339(since);
    let (since_arg, until_arg) = (since_text.clone(), until.to_string());

    let out = cli
        .ok(&[
            "targets", "redrive", "billing", "--since", &since_arg, "--until", &until_arg,
        ])
        .await;
    let until_text = redisched::view::rfc3339(until);
    assert_eq!(
        out,
        format!(
            "re-drove 3 parked job(s) of target billing that last failed in {since_text} .. {until_text}: due now\n  billing.eu  2\n  billing.us  1"
        )
    );
    assert_only_the_window_came_back(&store).await;

    // Again, as JSON: the same answer as REST, with nothing left to move.
    let json: Value = serde_json::from_str(
        &cli.ok(&[
            "targets", "redrive", "billing", "--since", &since_arg, "--until", &until_arg, "--json",
        ])
        .await,
    )
    .unwrap();
    assert_eq!(
        json,
        json!({
            "target": "billing",
            "since": since, "since_rfc3339": since_text,
            "until": until, "until_rfc3339": until_text,
            "redriven": 0,
            "topics": [
                {"topic": "billing.eu", "redriven": 0},
                {"topic": "billing.us", "redriven": 0},
            ],
        })
    );
    let out = cli
        .ok(&[
            "targets", "redrive", "billing", "--since", &since_arg, "--until", &until_arg,
        ])
        .await;
    assert!(
        out.starts_with("no parked job of target billing last failed in ")
            && out.ends_with("(2 topic(s) looked at)"),
        "{out}"
    );

    // Errors in the user's terms, with their exit codes.
    let (code, err) = cli.run(&["targets", "redrive", "biling"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("no webhook target named \"biling\" (configured: billing, mail)"),
        "{err}"
    );
    let (code, err) = cli
        .run(&["targets", "redrive", "billing", "--since", "last tuesday"])
        .await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--since must be epoch milliseconds or an RFC 3339 time"),
        "{err}"
    );
    let (code, err) = cli
        .run(&[
            "targets", "redrive", "billing", "--since", "2000", "--until", "1000",
        ])
        .await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--since 2000 is after --until 1000"), "{err}");

    // The defaults: everything up to now; `redisched targets` alone still lists.
    let out = cli.ok(&["targets", "redrive", "billing"]).await;
    assert!(
        out.starts_with("re-drove 2 parked job(s) of target billing"),
        "{out}"
    );
    assert_eq!(state(&store, "mail", "mail-1").await, JobState::Parked);
    let listed = cli.ok(&["targets"]).await;
    assert!(listed.starts_with("billing  topics billing.#"), "{listed}");
    let out = cli.ok(&["targets", "redrive", "mail"]).await;
    assert!(out.contains("\n  mail  1"), "{out}");
}

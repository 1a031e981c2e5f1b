//! A topic held by its webhook target's breaker, through both faces against a real Redis:
//! `held_by` in `GET /v1/topics` and `redisched stats --json` (the same JSON), the `HELD
//! BY` column of `redisched stats` (before `PAUSED`, which stays last), `null` and `-` for
//! a topic of no target and once the target is closed again.

use crate::common;

use std::path::PathBuf;

use clap::Parser;
use redisched::config::Config;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{HealthOp, PutRequest, Store};
use redisched::targets::{BreakerConfig, TargetConfig};
use serde_json::{json, Value};

/// `billing` serves `billing.#`, `mail` serves `mail`; both open at 3 failures of 3.
fn targets() -> Vec<TargetConfig> {
    [("billing", "billing.#"), ("mail", "mail")]
        .into_iter()
        .map(|(name, pattern)| TargetConfig {
            name: name.into(),
            topics: vec![pattern.into()],
            url: "http://127.0.0.1:9/hook".into(),
            breaker: BreakerConfig {
                failure_ratio: 0.5,
                window_ms: 60_000,
                min_requests: 3,
                open_ms: 600_000,
                disable_after_trips: 100,
            },
            ..TargetConfig::default()
        })
        .collect()
}

/// The `redisched` command line in-process (see tests/faces/features_cli.rs for why not
/// the binary) with a config file naming this test's Redis, prefix and targets.
struct Cli {
    config: PathBuf,
}

impl Cli {
    fn new(prefix: &str) -> Self {
        #[derive(serde::Serialize)]
        struct File {
            redis: Value,
            targets: Vec<TargetConfig>,
        }
        let config = std::env::temp_dir().join(format!("{}.toml", common::unique("heldby")));
        let file = File {
            redis: json!({"url": common::redis_url(), "prefix": prefix}),
            targets: targets(),
        };
        std::fs::write(&config, toml::to_string(&file).unwrap()).expect("write the config");
        Self { config }
    }

    /// What a successful command printed.
    async fn ok(&self, args: &[&str], json: bool) -> String {
        let config = self.config.to_string_lossy().into_owned();
        let argv = ["redisched", "--config", config.as_str()]
            .into_iter()
            .chain(args.iter().copied())
            .chain(json.then_some("--json"));
        let cli = redisched::cli::Cli::try_parse_from(argv).expect("arguments");
        match redisched::cli::execute(&cli).await {
            Ok(output) => output.render(cli.json),
            Err(err) => panic!("{args:?}: exit {}: {err}", err.exit_code()),
        }
    }

    async fn json(&self, args: &[&str]) -> Value {
        let out = self.ok(args, true).await;
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

async fn put(store: &Store, topic: &str, id: &str) {
    store
        .put(PutRequest {
            topic: Topic::new(topic).unwrap(),
            id: JobId::new(id).unwrap(),
            body: b"x".to_vec(),
            meta: Vec::new(),
            due: Due::Delay(600_000),
            mode: PutMode::Keep,
        })
        .await
        .expect("put");
}

/// `GET /v1/topics`.
async fn rest(api: &common::api::Served) -> Value {
    let res = api
        .client
        .get(format!("{}/v1/topics", api.base))
        .send()
        .await
        .expect("GET /v1/topics");
    assert!(res.status().is_success(), "{}", res.status());
    res.json().await.expect("JSON")
}

/// Each topic's `held_by` (the field must be there, `null` or not).
fn held(view: &Value) -> Vec<(String, Value)> {
    let rows = view["topics"].as_array().cloned().unwrap_or_default();
    let mut held: Vec<(String, Value)> = rows
        .iter()
        .map(|row| {
            let topic = row["topic"].as_str().unwrap_or_default().to_owned();
            let field = row.get("held_by").cloned();
            (topic, field.unwrap_or_else(|| panic!("no held_by: {row}")))
        })
        .collect();
    held.sort_by(|a, b| a.0.cmp(&b.0));
    held
}

/// The human `stats` row of `topic`, split on whitespace.
fn row_of(table: &str, topic: &str) -> Vec<String> {
    let row = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(topic))
        .unwrap_or_else(|| panic!("no row of {topic}:\n{table}"));
    row.split_whitespace().map(str::to_owned).collect()
}

#[tokio::test]
async fn both_faces_show_a_topic_held_by_its_targets_breaker_and_null_once_closed() {
    let prefix = common::unique("heldby");
    let store = common::test_store_owning(&prefix).await;
    let config = Config {
        targets: targets(),
        ..Config::default()
    };
    config.validate().expect("a valid test config");
    let api = common::api::serve(store.store.clone(), config.clone()).await;
    let cli = Cli::new(&prefix);
    for (topic, id) in [("billing.eu", "i1"), ("mail", "m1"), ("plain", "p1")] {
        put(&store, topic, id).await;
    }
    let nothing = vec![
        ("billing.eu".to_owned(), Value::Null),
        ("mail".to_owned(), Value::Null),
        ("plain".to_owned(), Value::Null),
    ];
    assert_eq!(held(&rest(&api).await), nothing, "every target closed");
    let table = cli.ok(&["stats"], false).await;
    assert_eq!(row_of(&table, "billing.eu")[8..], ["-", "no"], "{table}");

    // The breaker opens `billing` (as a bridge's sync does); `mail` is disabled by hand.
    let billing = &config.targets[0];
    let sync = HealthOp::Sync {
        successes: 0,
        failures: 3,
        lease_ms: 0,
        reason: String::new(),
    };
    store
        .target_health(&billing.name, &billing.breaker, sync)
        .await
        .expect("sync");
    cli.ok(&["targets", "disable", "mail"], false).await;

    let from_rest = rest(&api).await;
    let shown = held(&from_rest);
    assert_eq!(
        shown,
        vec![
            (
                "billing.eu".to_owned(),
                json!({"target": "billing", "state": "open", "state_reason": "3 of 3 requests failed in the window"})
            ),
            (
                "mail".to_owned(),
                json!({"target": "mail", "state": "disabled", "state_reason": "disabled by hand"})
            ),
            ("plain".to_owned(), Value::Null),
        ]
    );
    assert_eq!(
        held(&cli.json(&["stats"]).await),
        shown,
        "the CLI answers the same JSON"
    );
    let one = cli.json(&["stats", "mail"]).await;
    assert_eq!(one["topics"][0]["held_by"]["state"], "disabled", "{one}");

    // The human table: HELD BY before PAUSED, which stays last.
    let table = cli.ok(&["stats"], false).await;
    let header = table.lines().next().unwrap_or_default();
    let (held_at, paused_at) = (header.find("HELD BY"), header.find("PAUSED"));
    assert!(
        held_at.is_some() && held_at < paused_at && header.trim_end().ends_with("PAUSED"),
        "{header}"
    );
    assert_eq!(
        row_of(&table, "billing.eu")[8..],
        ["billing", "(open)", "no"],
        "{table}"
    );
    assert_eq!(
        row_of(&table, "mail")[8..],
        ["mail", "(disabled)", "no"],
        "{table}"
    );
    assert_eq!(
        row_of(&table, "plain"),
        ["plain", "1", "0", "0", "0", "0", "0", "-", "-", "no"],
        "{table}"
    );
    // `redisched targets` reads the same state.
    let listed = cli.ok(&["targets"], false).await;
    assert!(listed.contains("state open"), "{listed}");
    assert!(listed.contains("state disabled"), "{listed}");

    // Enabled again: held by nothing, in both faces.
    for name in ["billing", "mail"] {
        let res = api
            .client
            .post(format!("{}/v1/targets/{name}/enable", api.base))
            .send()
            .await
            .expect("enable");
        assert!(res.status().is_success(), "{}", res.status());
    }
    assert_eq!(held(&rest(&api).await), nothing);
    assert_eq!(held(&cli.json(&["stats"]).await), nothing);
    api.shutdown.cancel();
}

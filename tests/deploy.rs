//! The deployment files in deploy/: the Kubernetes manifests against the Kubernetes
//! schemas (kubernetes-validate, offline), the Prometheus alert rules through
//! `promtool check rules` and their unit tests through `promtool test rules`, and the
//! Grafana dashboard: valid JSON whose queries parse and name only metrics a live
//! bridge exposes.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::faults::{free_port, TempDir};
use serde_json::Value;

const HOW_TO_INSTALL: &str = "install the tools with `bash scripts/deploy-deps.sh` \
     (promtool: Debian package `prometheus`; kubernetes-validate: `pip install kubernetes-validate`)";

/// Kubernetes versions the manifests must be valid for: an old one still in use and the
/// newest the installed kubernetes-validate ships schemas for (its default).
const KUBERNETES_VERSIONS: [Option<&str>; 2] = [Some("1.29.0"), None];

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|err| panic!("read {path}: {err}"))
}

/// Runs a tool: (success, everything it printed). Panics with how to install it if missing.
fn run(program: &str, args: &[&str], dir: &Path) -> (bool, String) {
    let output = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|err| panic!("cannot run {program}: {err}\n{HOW_TO_INSTALL}"));
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), printed)
}

/// The manifests to apply (not the kustomization, whose kind has no Kubernetes schema).
fn manifests() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(repo("deploy/kubernetes"))
        .expect("deploy/kubernetes")
        .map(|entry| {
            entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name.ends_with(".yaml") && name != "kustomization.yaml")
        .collect();
    names.sort();
    names
}

#[test]
fn kubernetes_manifests_are_valid_against_the_schemas() {
    let dir = repo("deploy/kubernetes");
    let names = manifests();
    for kind in [
        "deployment",
        "service",
        "configmap",
        "poddisruptionbudget",
        "secret.example",
    ] {
        assert!(
            names.contains(&format!("{kind}.yaml")),
            "no {kind}.yaml in {names:?}"
        );
    }
    for version in KUBERNETES_VERSIONS {
        let mut args = vec!["--strict", "--quiet"];
        if let Some(version) = version {
            args.extend(["--kubernetes-version", version]);
        }
        args.extend(names.iter().map(String::as_str));
        let (valid, printed) = run("kubernetes-validate", &args, &dir);
        assert!(
            valid && printed.trim().is_empty(),
            "kubernetes-validate {version:?}:\n{printed}"
        );
    }

    // The validator must be able to fail: a field the schema does not know.
    let bad = TempDir::new("k8s");
    let broken = read("deploy/kubernetes/service.yaml").replace("spec:", "spec:\n  bogusField: 1");
    let path = bad.path().join("service.yaml");
    std::fs::write(&path, broken).expect("write");
    let (valid, printed) = run(
        "kubernetes-validate",
        &["--strict", "--quiet", path.to_str().expect("path")],
        bad.path(),
    );
    assert!(!valid, "an unknown field passed:\n{printed}");

    // `kubectl apply -k` applies every manifest but the Secret example.
    let kustomization = read("deploy/kubernetes/kustomization.yaml");
    for name in names.iter().filter(|n| !n.contains("example")) {
        assert!(
            kustomization.contains(&format!("- {name}")),
            "{name} missing in kustomization.yaml"
        );
    }
    assert!(!kustomization.contains("- secret.example.yaml"));
}

/// The value of the first `key: value` line in `text` (YAML or TOML), trimmed.
fn value_of<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .map(str::trim)
        .find_map(|line| {
            line.strip_prefix(key)
                .and_then(|rest| rest.trim_start().strip_prefix([':', '=']))
        })
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {key} in\n{text}"))
}

#[test]
fn the_deployment_fits_the_bridge() {
    let deployment = read("deploy/kubernetes/deployment.yaml");
    let configmap = read("deploy/kubernetes/configmap.yaml");

    // SIGTERM budget: in-flight confirms (dispatch.shutdown_grace_ms), then the dispatch
    // channel and the connection close (CLOSE_TIMEOUT each), then the background tasks
    // (5 s, src/app.rs). The pod must not be killed before the bridge is done.
    let grace_ms: u64 = value_of(&configmap, "shutdown_grace_ms")
        .parse()
        .expect("shutdown_grace_ms");
    let budget = Duration::from_millis(grace_ms)
        + 2 * redisched::amqp::CLOSE_TIMEOUT
        + Duration::from_secs(5);
    let termination: u64 = value_of(&deployment, "terminationGracePeriodSeconds")
        .parse()
        .expect("terminationGracePeriodSeconds");
    assert!(
        Duration::from_secs(termination) >= budget,
        "terminationGracePeriodSeconds {termination} < shutdown budget {budget:?}"
    );
    assert!(
        Duration::from_secs(termination) <= budget * 2,
        "terminationGracePeriodSeconds {termination} far above the budget {budget:?}"
    );

    // The configuration the pod gets must pass the bridge's own strict check.
    let toml_start = configmap.find("redisched.toml: |").expect("redisched.toml");
    let file: String = configmap[toml_start..]
        .lines()
        .skip(1)
        .map(|line| line.strip_prefix("    ").unwrap_or(line.trim()))
        .collect::<Vec<_>>()
        .join("\n");
    let dir = TempDir::new("cfg");
    let path = dir.path().join("redisched.toml");
    std::fs::write(&path, &file).expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_redisched"))
        .args(["--config", path.to_str().expect("path"), "check-config"])
        .env("REDISCHED_HTTP__TOKEN", "from-the-secret")
        .output()
        .expect("redisched check-config");
    assert!(
        output.status.success(),
        "check-config on the ConfigMap's file:\n{}{}\n{file}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(value_of(&file, "listen"), "\"0.0.0.0:7171\"");

    for needle in [
        "enableServiceLinks: false",
        "path: /readyz",
        "path: /healthz",
        "name: redisched",
        "/etc/redisched/redisched.toml",
    ] {
        assert!(
            deployment.contains(needle),
            "{needle:?} missing in deployment.yaml"
        );
    }
    // Every key of the Secret example is a variable the loader knows.
    let secret = read("deploy/kubernetes/secret.example.yaml");
    let mut env: Vec<(String, String)> = secret
        .lines()
        .map(str::trim)
        .filter(|line| line.starts_with("REDISCHED_"))
        .filter_map(|line| line.split_once(": "))
        .map(|(key, value)| (key.to_string(), value.trim_matches('"').to_string()))
        .collect();
    assert_eq!(env.len(), 3, "{env:?}");
    env.push(("REDISCHED_HTTP__LISTEN".into(), "0.0.0.0:7171".into()));
    let output = Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("check-config")
        .envs(env)
        .output()
        .expect("redisched check-config");
    assert!(
        output.status.success(),
        "check-config with the Secret's variables:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn alert_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = repo("deploy/prometheus");
    let (ok, printed) = run(
        "promtool",
        &["check", "rules", "redisched-alerts.yml"],
        &dir,
    );
    assert!(ok, "promtool check rules:\n{printed}");
    assert!(printed.contains("SUCCESS"), "{printed}");
    let (ok, printed) = run(
        "promtool",
        &["test", "rules", "redisched-alerts.test.yml"],
        &dir,
    );
    assert!(ok, "promtool test rules:\n{printed}");

    // Every alert of the rules file has a unit test.
    let rules = read("deploy/prometheus/redisched-alerts.yml");
    let tests = read("deploy/prometheus/redisched-alerts.test.yml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 8, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - exp_labels"
            )),
            "no test where {alert} fires"
        );
    }
}

/// Every query of the dashboard: panel targets and template variable queries.
fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    let mut queries = Vec::new();
    let mut stack = vec![dashboard];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(map) => {
                for (key, inner) in map {
                    match (key.as_str(), inner) {
                        ("expr", Value::String(expr)) => queries.push(expr.clone()),
                        ("definition", Value::String(query)) => queries.push(query.clone()),
                        _ => stack.push(inner),
                    }
                }
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    queries
}

fn dashboard() -> Value {
    serde_json::from_str(&read("deploy/prometheus/grafana-dashboard.json"))
        .expect("grafana-dashboard.json is valid JSON")
}

#[test]
fn dashboard_queries_are_valid_promql() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "redisched");
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 15, "{queries:?}");
    // promtool parses PromQL in rule files: one recording rule per panel query, with
    // Grafana's variables replaced by what they expand to.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, query) in queries
        .iter()
        .filter(|q| !q.starts_with("label_values("))
        .enumerate()
    {
        let expr = query
            .replace("$__rate_interval", "5m")
            .replace("$instance", ".*")
            .replace("$topic", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(&expr).expect("quote")
        ));
    }
    let dir = TempDir::new("dash");
    std::fs::write(dir.path().join("dashboard-rules.yml"), &rules).expect("write");
    let (ok, printed) = run(
        "promtool",
        &["check", "rules", "dashboard-rules.yml"],
        dir.path(),
    );
    assert!(ok, "a dashboard query does not parse:\n{printed}\n{rules}");
}

/// The `redisched_*` names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("redisched_") {
        let preceded = rest[..at]
            .chars()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        if !preceded {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_rules_name_only_metrics_a_live_bridge_exposes() {
    let mut config = test_config("deploy");
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{}", free_port());
    // A webhook target with one delivery, so its health gauge (the alert rules') shows.
    let receiver = common::receiver::Receiver::start().await;
    config.targets = vec![redisched::targets::TargetConfig {
        name: "deployhook".into(),
        topics: vec!["deploy.hook.#".into()],
        url: receiver.url("/"),
        ..redisched::targets::TargetConfig::default()
    }];
    config.validate().expect("valid test config");
    let base = format!("http://{}", config.http.listen);
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    broker.put("deploy.hook.a", "hooked", b"", &[]).await;

    // A fresh bridge, nothing scheduled: every family must already be there, but for
    // the labelled counters a family shows only once it has a series: one job expires
    // (put while its topic is paused, 1 ms of expiry, then resumed).
    let store = common::test_store_named(&config.redis.prefix).await;
    let topic = redisched::job::Topic::new("deploy.expiring").unwrap();
    store.pause(&topic).await.expect("pause");
    let expiry = (
        "x-redisched-expires-after",
        lapin::types::AMQPValue::LongInt(1),
    );
    broker.put(topic.as_str(), "late", b"", &[expiry]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.resume(&topic).await.expect("resume");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let scrape = loop {
        if let Ok(response) = client.get(format!("{base}/metrics")).send().await {
            if response.status() == 200 {
                let text = response.text().await.expect("body");
                if text.contains("redisched_jobs_expired_total{")
                    && text.contains("redisched_webhook_target_state{")
                {
                    break text;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no /metrics with the expired job and the target's state within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut exposed = BTreeSet::new();
    for line in scrape.lines() {
        let name = match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split(' ').next(),
            None if line.starts_with('#') => None,
            None => line.split(['{', ' ']).next(),
        };
        exposed.extend(name.map(str::to_string));
    }
    assert!(
        exposed.contains("redisched_dispatch_lateness_seconds_bucket"),
        "{scrape}"
    );

    let dashboard = dashboard();
    let used: BTreeSet<String> = dashboard_queries(&dashboard)
        .iter()
        .flat_map(|query| metric_names(query))
        .collect();
    assert!(used.len() >= 15, "{used:?}");
    let unknown: Vec<_> = used.difference(&exposed).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard queries {unknown:?}, not in\n{scrape}"
    );

    let rules = metric_names(&read("deploy/prometheus/redisched-alerts.yml"));
    let unknown: Vec<_> = rules.difference(&exposed).collect();
    assert!(
        unknown.is_empty(),
        "the alert rules query {unknown:?}, not in\n{scrape}"
    );
    // The rules' unit tests feed series of the same names.
    let tested = metric_names(&read("deploy/prometheus/redisched-alerts.test.yml"));
    let unknown: Vec<_> = tested.difference(&exposed).collect();
    assert!(
        unknown.is_empty(),
        "the rule tests use {unknown:?}, not in\n{scrape}"
    );

    bridge.stop().await;
    broker.cleanup().await;
}

//! The OpenAPI document against the live server: `openapi-spec-validator` on the served
//! document, a bounded `schemathesis` run (no 5xx, no answer the document does not
//! describe, valid requests accepted and invalid ones refused), and one assertion per
//! case where the two once disagreed. Both tools come from PyPI
//! (`bash scripts/openapi-deps.sh` installs them).

use crate::common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::faults::TempDir;
use redisched::config::Config;
use redisched::http::AppState;
use redisched::store::Limits;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

const HOW_TO_INSTALL: &str = "install the OpenAPI test tools with: bash scripts/openapi-deps.sh  \
     (pip install schemathesis==4.32.5 openapi-spec-validator)";

/// A live API over a store of its own key prefix; shut down and cleaned up on drop.
struct Server {
    base: String,
    client: reqwest::Client,
    state: AppState,
    shutdown: CancellationToken,
    _store: common::TestStore,
}

impl Server {
    async fn start(limits: Limits) -> Self {
        let store = common::test_store_with(limits).await;
        let common::api::Served {
            base,
            client,
            state,
            shutdown,
            ..
        } = common::api::serve(store.store.clone(), Config::default()).await;
        Self {
            base,
            client,
            state,
            shutdown,
            _store: store,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let res = req.send().await.expect("request");
        let status = res.status();
        (status, res.json().await.unwrap_or(Value::Null))
    }

    async fn document(&self) -> Value {
        let (status, doc) = self
            .send(self.client.get(self.url("/v1/openapi.json")))
            .await;
        assert_eq!(status, StatusCode::OK);
        doc
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// `program` if it is on PATH; otherwise the test fails saying how to install it.
fn tool(program: &str) -> &str {
    let found = std::process::Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    assert!(found, "{program} is not installed: {HOW_TO_INSTALL}");
    program
}

/// Runs `command` for at most `limit`; its exit status and its output (stdout, stderr).
async fn run(mut command: tokio::process::Command, limit: Duration) -> (bool, String) {
    command.kill_on_drop(true).stdin(Stdio::null());
    let output = tokio::time::timeout(limit, command.output())
        .await
        .unwrap_or_else(|_| panic!("{command:?} ran longer than {limit:?}"))
        .expect("run the tool");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

const LIMITS: Limits = common::DEFAULT_LIMITS;

#[tokio::test]
async fn the_served_document_is_valid_openapi_with_the_configured_limits() {
    let validator = tool("openapi-spec-validator");
    let limits = Limits {
        max_delay_ms: 90_000,
        ..LIMITS
    };
    let s = Server::start(limits).await;
    let doc = s.document().await;
    let dir = TempDir::new("openapi");
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, doc.to_string()).expect("write the document");
    let mut command = tokio::process::Command::new(validator);
    command.arg(&file);
    let (ok, output) = run(command, Duration::from_secs(60)).await;
    assert!(ok, "openapi-spec-validator refused the document:\n{output}");
    assert!(output.contains("OK"), "{output}");

    // The configured limit, not the default, is what the document states.
    let put = &doc["paths"]["/v1/topics/{topic}/jobs/{id}"]["put"];
    let due = put["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "due")
        .unwrap();
    assert_eq!(
        due["schema"]["properties"]["delay_ms"]["maximum"],
        json!(90_000)
    );
    let delay = &doc["paths"]["/schedule/{topic}"]["post"]["requestBody"]["content"]
        ["application/json"]["schema"]["properties"]["delay"];
    assert_eq!(delay["anyOf"][0]["maximum"], json!(90.0));
}

/// schemathesis's own configuration for the run: valid requests must be accepted
/// (2xx or 404), except a put whose `at` is past `limits.max_delay_ms` from the
/// server's now, which no schema can bound: the document says 422 `delay_too_long` for
/// it. (`delay` of `/schedule`, a number or a string, is bounded by the schema.)
const SCHEMATHESIS_TOML: &str = r#"
[[operations]]
include-operation-id = "putJob"
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "422"]

"#;

/// What the document cannot state, applied to requests generated as valid (one generated
/// as invalid is sent as it is): `every`, `cron` and `tz` of a put are specs only the
/// server can judge (a cron expression, an IANA zone, an interval over
/// `limits.min_interval_ms`): a valid request leaves them out; their own tests cover
/// valid specs. (That `every` and `cron`, or `delay_ms` and `at`, exclude each other the
/// document states.)
const SCHEMATHESIS_HOOKS: &str = r#"
import schemathesis


@schemathesis.hook
def before_call(context, case, kwargs):
    query = case.query
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if not positive or not query:
        return
    if case.operation.method.upper() == "PUT":
        for name in ("every", "cron", "tz"):
            query.pop(name, None)
        if isinstance(query.get("recurrence"), dict):
            query.pop("recurrence")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: bash scripts/test.sh runs it"]
async fn schemathesis_finds_no_disagreement_with_the_live_api() {
    let schemathesis = tool("schemathesis");
    // A new seed each run explores further over time; the seed is printed, and
    // OPENAPI_TEST_SEED=<seed> repeats a run (OPENAPI_TEST_EXAMPLES: cases per operation).
    let seed =
        std::env::var("OPENAPI_TEST_SEED").unwrap_or_else(|_| rand::random::<u32>().to_string());
    eprintln!("schemathesis seed {seed}: OPENAPI_TEST_SEED={seed} repeats this run");
    let examples = std::env::var("OPENAPI_TEST_EXAMPLES").unwrap_or_else(|_| "40".into());
    let s = Server::start(LIMITS).await;
    // As when a bridge has declared its topology: /readyz answers 200, not 503.
    s.state.metrics.set_topology_ready(true);
    let dir = TempDir::new("openapi");
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(&config, SCHEMATHESIS_TOML).expect("write the config");
    let hooks = dir.path().join("redisched_hooks.py");
    std::fs::write(&hooks, SCHEMATHESIS_HOOKS).expect("write the hooks");
    let mut command = tokio::process::Command::new(schemathesis);
    command
        .current_dir(dir.path())
        .env("SCHEMATHESIS_HOOKS", &hooks)
        .arg("--config-file")
        .arg(&config)
        .arg("--no-color")
        .arg("run")
        .arg(s.url("/v1/openapi.json"))
        .args(["--url", &s.base])
        .args(["--checks", "all"])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args(["--max-examples", &examples])
        .args(["--seed", &seed])
        // One worker: hypothesis's lambda descriptions are not thread-safe on CPython 3.11.
        .args(["--workers", "1"])
        .args(["--request-timeout", "10"])
        .args(["--generation-database", "none"])
        // An endless event stream: nothing to check by sampling it.
        .args(["--exclude-path", "/v1/events"])
        .args(["--report-dir", &dir.path().display().to_string()]);
    // ~40 s for 40 cases per operation here; more cases, more time.
    let budget = 110 * examples.parse::<u64>().unwrap_or(40).div_ceil(40).max(1);
    let (ok, output) = run(command, Duration::from_secs(budget)).await;
    eprintln!("{output}");
    assert!(
        ok,
        "schemathesis (seed {seed}, OPENAPI_TEST_SEED={seed} repeats it) found disagreements:\n{output}"
    );
    assert!(
        output.contains("Tested: 10") && output.contains("0 errors") || !output.contains("Error"),
        "schemathesis tested every operation without errors:\n{output}"
    );
}

/// `status` is among the responses the served document lists for `method path`.
fn documented(doc: &Value, path: &str, method: &str, status: StatusCode) -> bool {
    doc["paths"][path][method]["responses"]
        .get(status.as_str())
        .is_some()
}

#[tokio::test]
async fn each_former_disagreement_is_settled() {
    let limits = Limits {
        max_delay_ms: 3_600_000,
        ..LIMITS
    };
    let s = Server::start(limits).await;
    let doc = s.document().await;
    let job = "/v1/topics/{topic}/jobs/{id}";
    let jobs = "/v1/topics/{topic}/jobs";

    // (path and query, expected status, what the error says): each status documented.
    let puts: &[(&str, StatusCode, &str)] = &[
        // Job ids: no control characters, 1..256 bytes.
        ("/v1/topics/t/jobs/a%01b", StatusCode::BAD_REQUEST, "job id"),
        (
            "/v1/topics/t/jobs/a%C2%85b",
            StatusCode::BAD_REQUEST,
            "job id",
        ),
        ("/v1/topics/t/jobs/%C3%A9%C3%A9", StatusCode::CREATED, ""),
        // Topics: the pattern and at most 200 bytes.
        ("/v1/topics/a%20b/jobs/x", StatusCode::BAD_REQUEST, "topic"),
        ("/v1/topics/a%2Fb.c:d_e-f/jobs/x", StatusCode::CREATED, ""),
        // delay_ms and at together: 400, as the document says.
        (
            "/v1/topics/t/jobs/x?delay_ms=1&at=2",
            StatusCode::BAD_REQUEST,
            "not both",
        ),
        // Empty values are outside the schema: refused.
        ("/v1/topics/t/jobs/x?mode=", StatusCode::BAD_REQUEST, "mode"),
        (
            "/v1/topics/t/jobs/x?replace=",
            StatusCode::BAD_REQUEST,
            "replace",
        ),
        (
            "/v1/topics/t/jobs/x?delay_ms=",
            StatusCode::BAD_REQUEST,
            "delay_ms",
        ),
        (
            "/v1/topics/t/jobs/x?at=",
            StatusCode::BAD_REQUEST,
            "at must be",
        ),
        (
            "/v1/topics/t/jobs/x?delay_ms=+5",
            StatusCode::BAD_REQUEST,
            "delay_ms",
        ),
        // Delays: up to the configured limit; beyond it 422, beyond any time 400.
        (
            "/v1/topics/t/jobs/d1?delay_ms=3600000",
            StatusCode::CREATED,
            "",
        ),
        (
            "/v1/topics/t/jobs/d2?delay_ms=3600001",
            StatusCode::UNPROCESSABLE_ENTITY,
            "delay_too_long",
        ),
        (
            "/v1/topics/t/jobs/d3?delay_ms=123456789012345678901234567890",
            StatusCode::BAD_REQUEST,
            "out of range",
        ),
        // `at`: beyond the maximum delay is 422 (documented); 17 digits are out of range.
        (
            "/v1/topics/t/jobs/a1?at=9999999999999999",
            StatusCode::UNPROCESSABLE_ENTITY,
            "delay_too_long",
        ),
        (
            "/v1/topics/t/jobs/a2?at=00000000000000001",
            StatusCode::BAD_REQUEST,
            "out of range",
        ),
        (
            "/v1/topics/t/jobs/a3?at=2030-02-30T00:00:00Z",
            StatusCode::BAD_REQUEST,
            "RFC 3339",
        ),
        (
            "/v1/topics/t/jobs/a4?at=2000-01-01T00:00:00.5Z",
            StatusCode::CREATED,
            "",
        ),
    ];
    for &(path, want, says) in puts {
        let (status, body) = s.send(s.client.put(s.url(path)).body("b")).await;
        assert_eq!(status, want, "PUT {path}: {body}");
        assert!(
            documented(&doc, job, "put", status),
            "PUT {path}: {status} undocumented"
        );
        if !says.is_empty() {
            assert!(
                body.to_string().contains(says),
                "PUT {path}: {body} should say {says:?}"
            );
        }
    }
    // A path segment that is not UTF-8: a JSON error like every other (the document
    // says every error body is JSON), not the framework's plain text.
    for (method, path) in [
        (reqwest::Method::GET, "/v1/topics/%FF/jobs"),
        (reqwest::Method::PUT, "/v1/topics/t/jobs/%FF"),
        (reqwest::Method::DELETE, "/v1/topics/t/jobs/%FF"),
        (reqwest::Method::POST, "/schedule/%FF"),
    ] {
        let res = s
            .client
            .request(method.clone(), s.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{method} {path}");
        let body: Value = res.json().await.expect("a JSON error body");
        assert!(body["error"].is_string(), "{method} {path}: {body}");
    }
    let long_ascii = "x".repeat(256);
    let (status, body) = s
        .send(
            s.client
                .put(s.url(&format!("/v1/topics/t/jobs/{long_ascii}")))
                .body("b"),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "256 ASCII bytes: {body}");
    // 129 characters but 258 bytes: the limit is in bytes, as the document says.
    let long_utf8 = "%C3%A9".repeat(129);
    let (status, body) = s
        .send(
            s.client
                .put(s.url(&format!("/v1/topics/t/jobs/{long_utf8}")))
                .body("b"),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "258 bytes: {body}");
    let long_topic = "t".repeat(201);
    let (status, _) = s
        .send(
            s.client
                .put(s.url(&format!("/v1/topics/{long_topic}/jobs/x")))
                .body("b"),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "201-byte topic");

    // Listing: offset up to the cap lua/list.lua has (documented), empty values refused.
    let lists: &[(&str, StatusCode)] = &[
        ("/v1/topics/t/jobs?offset=1000000000000", StatusCode::OK),
        (
            "/v1/topics/t/jobs?offset=1000000000001",
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/topics/t/jobs?offset=99999999999999999999999",
            StatusCode::BAD_REQUEST,
        ),
        ("/v1/topics/t/jobs?limit=1000", StatusCode::OK),
        ("/v1/topics/t/jobs?limit=1001", StatusCode::BAD_REQUEST),
        ("/v1/topics/t/jobs?limit=", StatusCode::BAD_REQUEST),
        ("/v1/topics/t/jobs?offset=", StatusCode::BAD_REQUEST),
        ("/v1/topics/t/jobs?limit=%205", StatusCode::BAD_REQUEST),
    ];
    for &(path, want) in lists {
        let (status, body) = s.send(s.client.get(s.url(path))).await;
        assert_eq!(status, want, "GET {path}: {body}");
        assert!(
            documented(&doc, jobs, "get", status),
            "GET {path}: {status} undocumented"
        );
    }
    let offset = &doc["paths"][jobs]["get"]["parameters"][1];
    assert_eq!(offset["schema"]["maximum"], json!(1_000_000_000_000u64));

    // The original interface: a numeric id is allowed (the schema says so) and is the
    // id "0"; an empty id or one of another type is refused; delays are bounded.
    let schedule = "/schedule/{topic}";
    let cancel = "/cancel/{topic}";
    let (status, body) = s
        .send(s.client.post(s.url("/schedule/0")).json(&json!({"id": 0})))
        .await;
    assert_eq!(
        (status, &body["id"]),
        (StatusCode::CREATED, &json!("0")),
        "{body}"
    );
    let (status, _) = s.send(s.client.get(s.url("/v1/topics/0/jobs/0"))).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = s
        .send(s.client.post(s.url("/cancel/0")).json(&json!({"id": 0})))
        .await;
    assert_eq!(
        (status, &body["deleted"]),
        (StatusCode::OK, &json!(true)),
        "{body}"
    );
    let compat: &[(&str, Value, StatusCode)] = &[
        ("/cancel/t", json!({"id": ""}), StatusCode::BAD_REQUEST),
        ("/cancel/t", json!({"id": null}), StatusCode::BAD_REQUEST),
        ("/cancel/t", json!({"id": "nope"}), StatusCode::NOT_FOUND),
        ("/schedule/t", json!({"id": ""}), StatusCode::BAD_REQUEST),
        ("/schedule/t", json!({"id": true}), StatusCode::BAD_REQUEST),
        (
            "/schedule/t",
            json!({"id": "a\u{7}b"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/schedule/t",
            json!({"id": "c1", "delay": 3600}),
            StatusCode::CREATED,
        ),
        (
            "/schedule/t",
            json!({"id": "c2", "delay": 3600.001}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "/schedule/t",
            json!({"id": "c3", "delay": 1e300}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "/schedule/t",
            json!({"id": "c4", "delay": -1e300}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/schedule/t",
            json!({"id": "c5", "delay": "7200"}),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "/schedule/t",
            json!({"id": "c6", "delay": " 1"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/schedule/t",
            json!({"id": "c7", "delay": null, "contents": [1]}),
            StatusCode::CREATED,
        ),
    ];
    for (path, request, want) in compat {
        let (status, body) = s.send(s.client.post(s.url(path)).json(request)).await;
        assert_eq!(status, *want, "POST {path} {request}: {body}");
        let (template, what) = if path.starts_with("/cancel") {
            (cancel, "cancel")
        } else {
            (schedule, "schedule")
        };
        assert!(
            documented(&doc, template, "post", status),
            "{what} {request}: {status} undocumented"
        );
    }
    let (status, _) = s
        .send(
            s.client
                .post(s.url("/cancel/t"))
                .header("content-type", "text/plain")
                .body("{\"id\":\"x\"}"),
        )
        .await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(documented(&doc, cancel, "post", status));
}

#[test]
fn the_deps_script_pins_the_versions_the_error_names() {
    let script = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/openapi-deps.sh"),
    )
    .expect("scripts/openapi-deps.sh");
    assert!(script.contains("SCHEMATHESIS_VERSION=4.32.5"), "{script}");
    assert!(HOW_TO_INSTALL.contains("schemathesis==4.32.5"));
}

/// Whether `instance` is valid against `schema` (JSON Schema draft 4, the base of
/// OpenAPI 3.0's schemas), by the `jsonschema` package schemathesis brings along.
async fn schema_accepts(doc: &Value, schema: &Value, instance: &Value) -> bool {
    let python = tool("python3");
    // `$ref`s point into the document's components.
    let mut schema = schema.clone();
    schema["components"] = doc["components"].clone();
    let script = "import json, sys, jsonschema\n\
                  schema, instance = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n\
                  print('valid' if jsonschema.Draft4Validator(schema).is_valid(instance) else 'invalid')";
    let mut command = tokio::process::Command::new(python);
    command
        .args(["-c", script])
        .arg(schema.to_string())
        .arg(instance.to_string());
    let (ok, output) = run(command, Duration::from_secs(30)).await;
    assert!(
        ok,
        "python3 -c jsonschema failed ({HOW_TO_INSTALL}):\n{output}"
    );
    output.trim() == "valid"
}

/// The requests schemathesis found refused though the document allowed them are now
/// outside the document, and the document's examples are valid on this server.
#[tokio::test]
async fn the_document_states_what_the_server_refuses() {
    let s = Server::start(LIMITS).await;
    let doc = s.document().await;
    let put = &doc["paths"]["/v1/topics/{topic}/jobs/{id}"]["put"];
    let param = |name: &str| -> Value {
        put["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no `{name}` parameter: {put}"))["schema"]
            .clone()
    };
    let compat = doc["paths"]["/schedule/{topic}"]["post"]["requestBody"]["content"]
        ["application/json"]["schema"]
        .clone();

    // `delay` as a string beyond limits.max_delay_ms / 1000 s: outside the schema, 422.
    for (delay, status) in [
        ("0304532528.03", StatusCode::UNPROCESSABLE_ENTITY),
        ("31622400.001", StatusCode::UNPROCESSABLE_ENTITY),
        ("31622400", StatusCode::CREATED),
        ("1.5", StatusCode::CREATED),
    ] {
        let body = json!({"id": format!("d-{delay}"), "delay": delay});
        let valid = schema_accepts(&doc, &compat, &body).await;
        let (got, answer) = s
            .send(s.client.post(s.url("/schedule/t")).json(&body))
            .await;
        assert_eq!(got, status, "delay {delay:?}: {answer}");
        assert_eq!(
            valid,
            status.is_success(),
            "the schema says {} for delay {delay:?}, the server {got}",
            if valid { "valid" } else { "invalid" }
        );
    }

    // Query parameters that exclude each other: outside the schema, 400.
    let recurrence = param("recurrence");
    let due = param("due");
    for (schema, query, valid) in [
        (
            &recurrence,
            json!({"every": "15m", "cron": "0 9 * * *"}),
            false,
        ),
        (&recurrence, json!({"tz": "Europe/Berlin"}), false),
        (
            &recurrence,
            json!({"cron": "0 9 * * *", "tz": "Europe/Berlin"}),
            true,
        ),
        (&recurrence, json!({"every": "15m"}), true),
        (&recurrence, json!({"jitter": "500"}), false),
        (&recurrence, json!({"every": "15m", "jitter": "500"}), true),
        (&recurrence, json!({"every": "15m", "jitter": "-5"}), false),
        (&due, json!({"delay_ms": 1, "at": "2"}), false),
        (&due, json!({"delay_ms": 1}), true),
    ] {
        assert_eq!(
            schema_accepts(&doc, schema, &query).await,
            valid,
            "{query} against {schema}"
        );
        let pairs: Vec<(String, String)> = query
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().map_or(v.to_string(), str::to_string)))
            .collect();
        let (status, answer) = s
            .send(
                s.client
                    .put(s.url(&format!("/v1/topics/t/jobs/q{}", pairs.len())))
                    .query(&pairs),
            )
            .await;
        if valid {
            assert!(status.is_success(), "{query}: {status} {answer}");
        } else {
            assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {answer}");
        }
    }

    // The `at` example is within limits.max_delay_ms from now: the server takes it.
    let at = param("due")["properties"]["at"]["example"].clone();
    let at = at
        .as_str()
        .unwrap_or_else(|| panic!("an `at` example: {due}"));
    let (status, answer) = s
        .send(
            s.client
                .put(s.url("/v1/topics/t/jobs/example-at"))
                .query(&[("at", at)]),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "at={at}: {answer}");
    // And with a short limit, the example follows it.
    let short = Server::start(Limits {
        max_delay_ms: 90_000,
        ..LIMITS
    })
    .await;
    let doc = short.document().await;
    let at = doc["paths"]["/v1/topics/{topic}/jobs/{id}"]["put"]["parameters"][0]["schema"]
        ["properties"]["at"]["example"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, answer) = short
        .send(
            short
                .client
                .put(short.url("/v1/topics/t/jobs/example-at"))
                .query(&[("at", at.as_str())]),
        )
        .await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "at={at} with a 90 s limit: {answer}"
    );
}

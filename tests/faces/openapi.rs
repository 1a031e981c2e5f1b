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

/// schemathesis's own configuration for the run (nothing in it changes a generated
/// request):
/// - valid requests must be accepted (2xx or 404), except a put the document answers
///   with 422 for rules no schema can state: an `at` past `limits.max_delay_ms` from the
///   server's now (`delay_too_long`), a well-formed `every`, `cron`, `tz` or `jitter` the
///   server cannot use (`invalid_schedule`: an interval below `limits.min_interval_ms`,
///   a zone not in the IANA database, a cron expression that never fires…), a `url` no
///   webhook target admits (`url_not_allowed`). (`delay` of `/schedule` is bounded by
///   the schema.)
/// - a topic's rate limit is not a resource that a `DELETE` removes: it removes the live
///   limit, and `GET` then shows the one in force (the `[[policies]]` default, or none),
///   as documented; the stateful phase's use-after-free check does not apply to it.
/// - a delete by id prefix removes the jobs it names, not the topic's job list nor the
///   other jobs under that path: it takes no part in the stateful sequences, whose
///   use-after-free check would read it as removing `/v1/topics/{topic}/jobs` and
///   everything below (it is still run alone in the other phases).
const SCHEMATHESIS_TOML: &str = r#"
[[operations]]
include-operation-id = "putJob"
checks.positive_data_acceptance.expected-statuses = ["2xx", "404", "422"]

[[operations]]
include-operation-id = "getRateLimit"
checks.use_after_free.enabled = false

[[operations]]
include-operation-id = "deleteJobsByPrefix"
phases.stateful.enabled = false
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
    let mut command = tokio::process::Command::new(schemathesis);
    command
        .current_dir(dir.path())
        .arg("--config-file")
        .arg(&config)
        .arg("--no-color")
        .arg("run")
        .arg(s.url("/v1/openapi.json"))
        .args(["--url", &s.base])
        // No `--checks all`: schemathesis 4 runs every check by default (but
        // max_response_time, which needs a limit), and the command-line flag would
        // override the per-operation settings of SCHEMATHESIS_TOML.
        // Stateful: sequences of calls linked by the ids they return (put, get, delete…).
        .args(["--phases", "examples,coverage,fuzzing,stateful"])
        .args(["--max-examples", &examples])
        .args(["--seed", &seed])
        // One worker: hypothesis's lambda descriptions are not thread-safe on CPython 3.11.
        .args(["--workers", "1"])
        .args(["--request-timeout", "10"])
        .args(["--generation-database", "none"])
        // An endless event stream: nothing to check by sampling it.
        .args(["--exclude-path", "/v1/events"])
        .args(["--report-dir", &dir.path().display().to_string()]);
    // ~50 s for 40 cases per operation here (stateful included); more cases, more time.
    let budget = 150 * examples.parse::<u64>().unwrap_or(40).div_ceil(40).max(1);
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
        // A parameter the document does not list (additionalProperties: false): 400,
        // not a job due now (schemathesis found one ignored).
        (
            "/v1/topics/t/jobs/x?dely_ms=60000",
            StatusCode::BAD_REQUEST,
            "unknown field `dely_ms`",
        ),
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
    for path in [
        "/v1/jobs?id_prefix=abcdef&idprefix=x",
        "/v1/topics/t/jobs?id_prefix=abcdef&x=1",
    ] {
        let (status, body) = s.send(s.client.delete(s.url(path))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "DELETE {path}: {body}");
        assert!(body.to_string().contains("unknown field"), "{body}");
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

/// Python that defines `schema_of(text)`: the JSON Schema of an OpenAPI 3.0 schema,
/// `nullable: true` read as OpenAPI means it (`null` is valid too), as schemathesis reads
/// it; draft 4 alone does not know `nullable` and would refuse every `null`. The
/// components stay at the root, where the `$ref`s point.
const SCHEMA_OF: &str = "import json, sys, jsonschema\n\
    def nullable(s):\n\
    \x20   if isinstance(s, list):\n\
    \x20       return [nullable(v) for v in s]\n\
    \x20   if not isinstance(s, dict):\n\
    \x20       return s\n\
    \x20   s = {k: nullable(v) for k, v in s.items()}\n\
    \x20   return {'anyOf': [s, {'type': 'null'}]} if s.pop('nullable', False) else s\n\
    def schema_of(text):\n\
    \x20   schema = json.loads(text)\n\
    \x20   components = nullable(schema.pop('components', {}))\n\
    \x20   return dict(nullable(schema), components=components)\n";

/// Whether `instance` is valid against `schema` (JSON Schema draft 4, the base of
/// OpenAPI 3.0's schemas, with `nullable`), by the `jsonschema` package schemathesis
/// brings along.
async fn schema_accepts(doc: &Value, schema: &Value, instance: &Value) -> bool {
    let python = tool("python3");
    // `$ref`s point into the document's components.
    let mut schema = schema.clone();
    schema["components"] = doc["components"].clone();
    let script = format!(
        "{SCHEMA_OF}schema, instance = schema_of(sys.argv[1]), json.loads(sys.argv[2])\n\
         print('valid' if jsonschema.Draft4Validator(schema).is_valid(instance) else 'invalid')"
    );
    let mut command = tokio::process::Command::new(python);
    command
        .args(["-c", script.as_str()])
        .arg(schema.to_string())
        .arg(instance.to_string());
    let (ok, output) = run(command, Duration::from_secs(30)).await;
    assert!(
        ok,
        "python3 -c jsonschema failed ({HOW_TO_INSTALL}):\n{output}"
    );
    output.trim() == "valid"
}

/// [`schema_accepts`] for many instances in one `python3` run.
async fn schema_accepts_each(doc: &Value, schema: &Value, instances: &[Value]) -> Vec<bool> {
    let python = tool("python3");
    let mut schema = schema.clone();
    schema["components"] = doc["components"].clone();
    let script = format!(
        "{SCHEMA_OF}v = jsonschema.Draft4Validator(schema_of(sys.argv[1]))\n\
         print(' '.join('valid' if v.is_valid(i) else 'invalid' for i in json.loads(sys.argv[2])))"
    );
    let mut command = tokio::process::Command::new(python);
    command
        .args(["-c", script.as_str()])
        .arg(schema.to_string())
        .arg(Value::Array(instances.to_vec()).to_string());
    let (ok, output) = run(command, Duration::from_secs(60)).await;
    assert!(
        ok,
        "python3 -c jsonschema failed ({HOW_TO_INSTALL}):\n{output}"
    );
    let verdicts: Vec<bool> = output.split_whitespace().map(|w| w == "valid").collect();
    assert_eq!(verdicts.len(), instances.len(), "{output}");
    verdicts
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

/// The schedule parameters of a put have the form the document states: a value the
/// document's schema refuses is a 400, one it allows is taken or refused with 422
/// `invalid_schedule` (rules no schema can state), never a 400.
#[tokio::test]
async fn schedule_values_are_refused_as_the_document_says() {
    let s = Server::start(LIMITS).await;
    let doc = s.document().await;
    let put = &doc["paths"]["/v1/topics/{topic}/jobs/{id}"]["put"];
    let recurrence = put["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "recurrence")
        .unwrap()["schema"]
        .clone();
    let cases: &[(&str, &str, &str)] = &[
        // (parameter, value, what goes with it)
        ("every", "15m", ""),
        ("every", "900000", ""),
        ("every", "1h30m", ""),
        ("every", "2w3d", ""),
        ("every", "10", ""),
        ("every", "0", ""),
        ("every", "999999999999999999999", ""),
        ("every", "soon", ""),
        ("every", "15 m", ""),
        ("every", "1.5h", ""),
        ("every", "15min", ""),
        ("every", "-5", ""),
        ("every", " 15m", ""),
        ("every", "1y", ""),
        ("cron", "0 9 * * MON-FRI", ""),
        ("cron", "*/5 * * * * *", ""),
        ("cron", "0 99 * * *", ""),
        ("cron", "0 0 30 2 *", ""),
        ("cron", "x y z w v", ""),
        ("cron", "0 9 * *", ""),
        ("cron", "0\t9 * * *", ""),
        ("cron", "@daily", ""),
        ("cron", "0 9 * * * * *", ""),
        ("tz", "Europe/Berlin", "cron"),
        ("tz", "Etc/GMT+5", "cron"),
        ("tz", "Mars/Olympus", "cron"),
        ("tz", "Europe Berlin", "cron"),
        ("tz", "/UTC", "cron"),
        ("jitter", "600000", "every"),
        ("jitter", "3600000", "every"),
        ("jitter", "9999999999999", "every"),
        ("jitter", "00000000000001", "every"),
        ("jitter", " 5", "every"),
        ("jitter", "-1", "every"),
        // No value ends with a newline, whatever a validator's `$` allows.
        ("every", "15m\n", ""),
        ("cron", "0 9 * * *\n", ""),
        ("tz", "UTC\n", "cron"),
        ("jitter", "5\n", "every"),
    ];
    let queries: Vec<Vec<(&str, &str)>> = cases
        .iter()
        .map(|&(name, value, with)| {
            let mut query = vec![(name, value)];
            match with {
                "cron" => query.push(("cron", "0 9 * * *")),
                "every" => query.push(("every", "1h")),
                _ => {}
            }
            query
        })
        .collect();
    let instances: Vec<Value> = queries
        .iter()
        .map(|query| {
            Value::Object(
                query
                    .iter()
                    .map(|(k, v)| (k.to_string(), json!(v)))
                    .collect(),
            )
        })
        .collect();
    let verdicts = schema_accepts_each(&doc, &recurrence, &instances).await;
    for (n, ((query, instance), valid)) in queries.iter().zip(&instances).zip(verdicts).enumerate()
    {
        let (status, answer) = s
            .send(
                s.client
                    .put(s.url(&format!("/v1/topics/forms/jobs/f{n}")))
                    .query(query),
            )
            .await;
        if valid {
            assert!(
                status.is_success() || status == StatusCode::UNPROCESSABLE_ENTITY,
                "{instance}: the schema allows it, the server answers {status} {answer}"
            );
            if status == StatusCode::UNPROCESSABLE_ENTITY {
                assert_eq!(answer["code"], "invalid_schedule", "{instance}: {answer}");
            }
        } else {
            assert_eq!(
                status,
                StatusCode::BAD_REQUEST,
                "{instance}: the schema refuses it: {answer}"
            );
        }
    }
    // Ids and topics: a final newline is refused by the server and by the document.
    let job_id = doc["components"]["schemas"]["JobId"].clone();
    let topic = doc["components"]["parameters"]["Topic"]["schema"].clone();
    let ids = [json!("abc"), json!("abc\n")];
    assert_eq!(
        schema_accepts_each(&doc, &job_id, &ids).await,
        [true, false]
    );
    assert_eq!(schema_accepts_each(&doc, &topic, &ids).await, [true, false]);
    for path in [
        "/v1/topics/forms/jobs/abc%0A",
        "/v1/topics/forms%0A/jobs/abc",
    ] {
        let (status, answer) = s.send(s.client.put(s.url(path))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {answer}");
    }
    // The document's code list names it.
    let codes = &doc["components"]["schemas"]["Error"]["properties"]["code"]["enum"];
    assert!(
        codes
            .as_array()
            .unwrap()
            .contains(&json!("invalid_schedule")),
        "{codes}"
    );
}

/// The original project's frontend sends its cancel as `POST /schedule/undefined {"id",
/// "type": "cancellation"}`: refused with a 400 that points at `POST /cancel/{topic}`,
/// as the document says, and nothing is scheduled. Another `type` is ignored as before.
#[tokio::test]
async fn a_cancel_sent_to_the_schedule_endpoint_points_at_cancel() {
    let s = Server::start(LIMITS).await;
    let doc = s.document().await;
    let schedule = "/schedule/{topic}";
    let request = json!({"id": "job-7", "type": "cancellation"});
    let (status, body) = s
        .send(s.client.post(s.url("/schedule/undefined")).json(&request))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("POST /cancel/undefined") && error.contains("nothing was scheduled"),
        "{body}"
    );
    assert!(documented(&doc, schedule, "post", status));
    let (status, _) = s
        .send(s.client.get(s.url("/v1/topics/undefined/jobs/job-7")))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "a job was scheduled");
    // The document's schema says so too.
    let schema = doc["paths"][schedule]["post"]["requestBody"]["content"]["application/json"]
        ["schema"]
        .clone();
    assert!(!schema_accepts(&doc, &schema, &request).await);
    let other = json!({"id": "job-8", "type": "schedule"});
    assert!(schema_accepts(&doc, &schema, &other).await);
    let (status, body) = s
        .send(s.client.post(s.url("/schedule/undefined")).json(&other))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    // Cancelled where the message points.
    let (status, body) = s
        .send(
            s.client
                .post(s.url("/cancel/undefined"))
                .json(&json!({"id": "job-8"})),
        )
        .await;
    assert_eq!((status, &body["deleted"]), (StatusCode::OK, &json!(true)));
}

/// A job `url` for a topic no webhook target serves: 422 `url_not_allowed`, documented.
#[tokio::test]
async fn a_job_url_no_target_admits_is_a_documented_422() {
    let s = Server::start(LIMITS).await;
    let doc = s.document().await;
    let (status, body) = s
        .send(
            s.client
                .put(s.url("/v1/topics/t/jobs/u1"))
                .query(&[("url", "https://hooks.example.com/tenant-7")])
                .body("b"),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["code"], "url_not_allowed", "{body}");
    assert!(documented(
        &doc,
        "/v1/topics/{topic}/jobs/{id}",
        "put",
        status
    ));
    let refused = doc["components"]["responses"]["Refused"]["description"]
        .as_str()
        .unwrap_or_default();
    assert!(refused.contains("url_not_allowed"), "{refused}");
}

/// `POST /v1/targets/{name}/enable` and `…/disable` answer as the document says: an
/// unknown target is a documented 404; the `Target` schema holds the breaker's fields.
#[tokio::test]
async fn the_target_health_endpoints_answer_as_documented() {
    let s = Server::start(LIMITS).await;
    let doc = s.document().await;
    for action in ["enable", "disable"] {
        let path = format!("/v1/targets/{{name}}/{action}");
        let (status, body) = s
            .send(
                s.client
                    .post(s.url(&format!("/v1/targets/nosuch/{action}"))),
            )
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
        assert!(documented(&doc, &path, "post", status), "{path}");
        assert!(documented(&doc, &path, "post", StatusCode::OK), "{path}");
    }
    let target = &doc["components"]["schemas"]["Target"]["properties"];
    for field in ["state", "held_by_breaker", "state_reason", "trips"] {
        assert!(target.get(field).is_some(), "Target.{field} documented");
    }
    let state = json!({
        "target": "billing", "state": "disabled", "held_by_breaker": true,
        "state_reason": "HTTP 410 Gone from billing: gone", "state_changed_at": 1,
        "state_changed_at_rfc3339": "1970-01-01T00:00:00.001Z", "trips": 0,
        "window_requests": 0, "window_failures": 0
    });
    let schema = json!({ "$ref": "#/components/schemas/TargetState" });
    assert!(schema_accepts(&doc, &schema, &state).await);
    assert!(
        !schema_accepts(
            &doc,
            &schema,
            &json!({ "target": "billing", "state": "sleepy" })
        )
        .await
    );
}

/// `GET /v1/topics` with a topic held by its target's breaker answers as the document
/// says: the answer is valid against the documented 200 schema; `held_by` takes an
/// object of the `HeldBy` schema or `null`, never a state that holds nothing (`closed`)
/// nor an object without its target.
#[tokio::test]
async fn a_topic_held_by_its_targets_breaker_answers_as_documented() {
    let store = common::test_store().await;
    let mut config = Config::default();
    config.targets.push(redisched::targets::TargetConfig {
        name: "billing".into(),
        topics: vec!["billing.#".into()],
        url: "http://127.0.0.1:9/hook".into(),
        ..Default::default()
    });
    config.validate().expect("a valid test config");
    let served = common::api::serve(store.store.clone(), config).await;
    let client = &served.client;
    let url = |path: &str| format!("{}{path}", served.base);
    for path in [
        "/v1/topics/billing.eu/jobs/i1?delay_ms=600000",
        "/v1/topics/plain/jobs/p1?delay_ms=600000",
    ] {
        let res = client.put(url(path)).body("x").send().await.expect("PUT");
        assert_eq!(res.status(), StatusCode::CREATED, "{path}");
    }
    let res = client
        .post(url("/v1/targets/billing/disable"))
        .send()
        .await
        .expect("disable");
    assert_eq!(res.status(), StatusCode::OK);
    let doc: Value = client
        .get(url("/v1/openapi.json"))
        .send()
        .await
        .expect("document")
        .json()
        .await
        .expect("JSON");
    let topics: Value = client
        .get(url("/v1/topics"))
        .send()
        .await
        .expect("GET /v1/topics")
        .json()
        .await
        .expect("JSON");
    let answer = &doc["paths"]["/v1/topics"]["get"]["responses"]["200"]["content"]
        ["application/json"]["schema"];
    assert!(
        schema_accepts(&doc, answer, &topics).await,
        "the documented schema refuses {topics}"
    );
    let rows = topics["topics"].as_array().cloned().unwrap_or_default();
    let held_of = |topic: &str| {
        rows.iter()
            .find(|r| r["topic"] == topic)
            .map(|r| r["held_by"].clone())
            .unwrap_or_else(|| panic!("no {topic}: {topics}"))
    };
    let held = held_of("billing.eu");
    assert_eq!(
        held,
        json!({"target": "billing", "state": "disabled", "state_reason": "disabled by hand"})
    );
    assert_eq!(held_of("plain"), Value::Null);
    let field = &doc["components"]["schemas"]["TopicStats"]["properties"]["held_by"];
    let verdicts = schema_accepts_each(
        &doc,
        field,
        &[
            held,
            Value::Null,
            json!({"target": "billing", "state": "half_open", "state_reason": null}),
            json!({"target": "billing", "state": "closed", "state_reason": null}),
            json!({"state": "open", "state_reason": "down"}),
        ],
    )
    .await;
    assert_eq!(verdicts, [true, true, true, false, false]);
    served.shutdown.cancel();
}

//! The `redisched` binary against a real Redis: every operator command, human and
//! `--json` output, exit codes, and `check-config`.

use crate::common;

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// Runs the binary under its own key prefix, with no `REDISCHED_*` variable leaking in
/// from the test environment.
struct Cli {
    prefix: String,
}

impl Cli {
    fn new() -> Self {
        Self {
            prefix: common::unique("cli"),
        }
    }

    fn command(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_redisched"));
        for (key, _) in std::env::vars() {
            if key.starts_with("REDISCHED_") || key == "RUST_LOG" {
                cmd.env_remove(key);
            }
        }
        cmd.env("REDISCHED_REDIS__URL", common::redis_url())
            .env("REDISCHED_REDIS__PREFIX", &self.prefix)
            .envs(env.iter().copied())
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    fn run_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        self.command(args, env).output().expect("run redisched")
    }

    fn run(&self, args: &[&str]) -> Output {
        self.run_env(args, &[])
    }

    /// Runs and expects exit code 0; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", describe(&out));
        String::from_utf8(out.stdout).expect("utf-8 stdout")
    }

    /// Runs with `--json`, expects exit code 0; returns the parsed stdout.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        let stdout = self.ok(&all);
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
    }

    fn with_stdin(&self, args: &[&str], input: &[u8]) -> Output {
        let mut child = self
            .command(args, &[])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        child.stdin.take().unwrap().write_all(input).unwrap();
        child.wait_with_output().unwrap()
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        common::delete_prefix(&self.prefix);
    }
}

fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn put_get_list_stats_delete_in_human_output() {
    let cli = Cli::new();
    let out = cli.ok(&[
        "put",
        "mails",
        "welcome-1",
        "{\"to\":\"ann\"}",
        "--delay",
        "90s",
    ]);
    assert!(out.starts_with("scheduled mails/welcome-1 due "), "{out}");
    assert!(
        out.contains("(in 1m 29s)") || out.contains("(in 1m 30s)"),
        "{out}"
    );
    cli.ok(&["put", "mails", "welcome-2", "--delay", "3d"]);

    let out = cli.ok(&["get", "mails", "welcome-1"]);
    for expected in [
        "state     scheduled",
        "attempts  0",
        "{\"to\":\"ann\"}",
        "id        welcome-1",
    ] {
        assert!(out.contains(expected), "missing {expected:?} in\n{out}");
    }

    let out = cli.ok(&["list", "mails"]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("ID"), "{out}");
    assert!(
        lines[1].starts_with("welcome-1") && lines[2].starts_with("welcome-2"),
        "{out}"
    );
    assert!(
        lines[2].contains("in 3days") || lines[2].contains("in 2days 23h"),
        "{out}"
    );

    let out = cli.ok(&["stats"]);
    let row = out
        .lines()
        .find(|l| l.starts_with("mails"))
        .unwrap_or_else(|| panic!("{out}"));
    assert_eq!(
        row.split_whitespace().collect::<Vec<_>>(),
        ["mails", "2", "0", "0", "0", "0", "0", "-", "-", "no"]
    );

    assert_eq!(
        cli.ok(&["delete", "mails", "welcome-1"]).trim(),
        "deleted mails/welcome-1"
    );
    let out = cli.run(&["delete", "mails", "welcome-1"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job welcome-1"));
    let out = cli.run(&["get", "mails", "welcome-1"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert_eq!(
        cli.ok(&["list", "nothing-here"]).trim(),
        "no scheduled jobs in topic nothing-here"
    );
}

#[test]
fn json_output_for_scripts() {
    let cli = Cli::new();
    let put = cli.json(&["put", "orders", "o-1", "first", "--delay", "250ms"]);
    assert_eq!(put["status"], "scheduled");
    assert_eq!(put["topic"], "orders");
    assert_eq!(put["body_bytes"], 5);
    assert_eq!(
        cli.json(&["put", "orders", "o-1", "second"])["status"],
        "duplicate"
    );
    // Ten days ahead, whole seconds: well inside the default max delay of 366 days.
    let at = std::time::SystemTime::now() + std::time::Duration::from_secs(10 * 86_400);
    let at_text = humantime::format_rfc3339_seconds(at).to_string();
    let at_ms = at.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64 * 1000;
    let replaced = cli.json(&[
        "put",
        "orders",
        "o-1",
        "third",
        "--at",
        &at_text,
        "--replace",
    ]);
    assert_eq!(replaced["status"], "replaced");
    assert_eq!(replaced["due_at"], at_ms);
    assert_eq!(
        replaced["due_at_rfc3339"],
        humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(at_ms as u64)
        )
        .to_string()
    );

    let job = cli.json(&["get", "orders", "o-1"]);
    assert_eq!(job["state"], "scheduled");
    assert_eq!(job["body"], "third");
    assert_eq!(job["encoding"], "utf-8");
    assert_eq!(job["attempts"], 0);
    assert_eq!(job["deadline"], Value::Null);

    // Body from stdin with `-`, and binary bodies from a file come back as base64.
    let out = cli.with_stdin(
        &["put", "orders", "o-2", "-", "--delay", "1h", "--json"],
        b"from stdin",
    );
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    assert_eq!(cli.json(&["get", "orders", "o-2"])["body"], "from stdin");
    let out = cli.with_stdin(
        &["put", "orders", "o-3", "--body-file", "-", "--delay", "2h"],
        b"piped file",
    );
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    assert_eq!(cli.json(&["get", "orders", "o-3"])["body"], "piped file");
    let file = std::env::temp_dir().join(format!("{}.bin", cli.prefix));
    std::fs::write(&file, [0u8, 159, 146, 150]).unwrap();
    cli.json(&[
        "put",
        "orders",
        "bin",
        "--body-file",
        file.to_str().unwrap(),
        "--delay",
        "3h",
    ]);
    let _ = std::fs::remove_file(&file);
    let job = cli.json(&["get", "orders", "bin"]);
    assert_eq!(
        (&job["body"], &job["encoding"]),
        (&Value::from("AJ+Slg=="), &Value::from("base64"))
    );
    assert_eq!(job["body_bytes"], 4);

    let list = cli.json(&["list", "orders", "--limit", "3"]);
    let ids: Vec<&str> = list["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["o-2", "o-3", "bin"]);
    // The same view as `GET /v1/topics/{topic}/jobs`: the server's clock too.
    assert!(list["now"].as_i64().unwrap() > 0, "{list}");
    let rest = cli.json(&["list", "orders", "--limit", "3", "--offset", "3"]);
    assert_eq!(rest["jobs"][0]["id"], "o-1");

    cli.ok(&["put", "other", "x"]);
    let stats = cli.json(&["stats"]);
    let topics: Vec<&str> = stats["topics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["topic"].as_str().unwrap())
        .collect();
    assert_eq!(topics, ["orders", "other"]);
    assert_eq!(stats["topics"][0]["scheduled"], 4);
    let one = cli.json(&["stats", "other"]);
    assert_eq!(one["topics"].as_array().unwrap().len(), 1);
    assert_eq!(
        (&one["topics"][0]["scheduled"], &one["topics"][0]["due_now"]),
        (&Value::from(1), &Value::from(1))
    );

    assert_eq!(cli.json(&["delete", "orders", "o-1"])["deleted"], true);
    let out = cli.run(&["delete", "orders", "o-1", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let err: Value = serde_json::from_slice(&out.stdout).expect("JSON error");
    assert_eq!(err["kind"], "not_found");
}

#[test]
fn exit_codes_mean_something() {
    let cli = Cli::new();
    let code = |args: &[&str], env: &[(&str, &str)]| {
        let out = cli.run_env(args, env);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            out,
        )
    };
    // 2: usage.
    for args in [
        &["put", "bad topic", "x"][..],
        &["put", "t", "x", "--delay", "soon"],
        &["put", "t", "x", "--at", "tomorrow"],
        &[
            "put",
            "t",
            "x",
            "--delay",
            "1s",
            "--at",
            "2030-01-01T00:00:00Z",
        ],
        &["put", "t", "x", "body", "--body-file", "f"],
        &["put", "t", "x", "--body-file", "/no/such/file"],
        &["list", "t", "--limit", "0"],
        &["frobnicate"],
        &[],
    ] {
        let (status, stderr, _) = code(args, &[]);
        assert_eq!(status, Some(2), "{args:?}: {stderr}");
    }
    // 3: Redis unreachable (nothing listens on port 1).
    let (status, stderr, _) = code(
        &["stats"],
        &[("REDISCHED_REDIS__URL", "redis://127.0.0.1:1/0")],
    );
    assert_eq!(status, Some(3), "{stderr}");
    assert!(stderr.contains("cannot reach Redis"), "{stderr}");
    // 4: refused by the store.
    let (status, stderr, _) = code(
        &["put", "t", "big", "12345"],
        &[("REDISCHED_LIMITS__MAX_BODY_BYTES", "4")],
    );
    assert_eq!(status, Some(4), "{stderr}");
    assert!(stderr.contains("body_too_large"), "{stderr}");
    let (status, _, out) = code(&["put", "t", "far", "--delay", "400d", "--json"], &[]);
    assert_eq!(status, Some(4));
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&err["kind"], &err["code"]),
        (&Value::from("refused"), &Value::from("delay_too_long"))
    );
    // 1: not found.
    assert_eq!(code(&["get", "t", "nope"], &[]).0, Some(1));
    // 0: help.
    let out = cli.run(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for word in [
        "run",
        "put",
        "delete",
        "get",
        "list",
        "stats",
        "check-config",
        "Exit codes",
        "--json",
        "--config",
    ] {
        assert!(help.contains(word), "--help mentions {word}:\n{help}");
    }
    let out = cli.run(&["put", "--help"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("--replace"));
}

#[test]
fn check_config_redacts_secrets_and_names_bad_keys() {
    let cli = Cli::new();
    let secrets = [
        ("REDISCHED_AMQP__URL", "amqp://app:hunter2@rabbit:5672/%2f"),
        ("REDISCHED_HTTP__TOKEN", "tok-very-secret"),
        ("REDISCHED_DISPATCH__TTR_MS", "45000"),
    ];
    let out = cli.run_env(&["check-config"], &secrets);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let toml_text = String::from_utf8(out.stdout).unwrap();
    assert!(
        !toml_text.contains("hunter2") && !toml_text.contains("tok-very-secret"),
        "{toml_text}"
    );
    assert!(
        toml_text.contains("amqp://app:***@rabbit:5672/%2f"),
        "{toml_text}"
    );
    assert!(
        toml_text.contains("[dispatch]") && toml_text.contains("ttr_ms = 45000"),
        "{toml_text}"
    );
    assert!(
        toml_text.contains(&format!("prefix = \"{}\"", cli.prefix)),
        "{toml_text}"
    );

    for args in [
        &["check-config", "--json"][..],
        &["check-config", "--format", "json"],
    ] {
        let out = cli.run_env(args, &secrets);
        assert_eq!(out.status.code(), Some(0));
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["http"]["token"], "***");
        assert_eq!(json["dispatch"]["ttr_ms"], 45000);
    }

    // A value out of range: named by its dotted key, exit 2, also for `run`.
    for args in [&["check-config"][..], &["run"], &["stats"]] {
        let out = cli.run_env(args, &[("REDISCHED_DISPATCH__TTR_MS", "5")]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", describe(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("dispatch.ttr_ms"),
            "{}",
            describe(&out)
        );
    }
    let out = cli.run_env(
        &["check-config", "--json"],
        &[("REDISCHED_DISPATCH__TTR_MS", "5")],
    );
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&err["kind"], &err["key"]),
        (&Value::from("config"), &Value::from("dispatch.ttr_ms"))
    );

    // A value of the wrong type and an unknown key are named too.
    let out = cli.run_env(&["check-config"], &[("REDISCHED_DISPATCH__TTR_MS", "soon")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("dispatch.ttr_ms"),
        "{}",
        describe(&out)
    );
    let out = cli.run_env(&["check-config"], &[("REDISCHED_DISPATCH__TTR", "5")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ttr"),
        "{}",
        describe(&out)
    );

    // A config file sits between defaults and env.
    let file = std::env::temp_dir().join(format!("{}.toml", cli.prefix));
    std::fs::write(
        &file,
        "[dispatch]\nbatch = 7\nttr_ms = 1000\n[log]\nformat = \"json\"\n",
    )
    .unwrap();
    let out = cli.run_env(
        &["check-config", "--json", "--config", file.to_str().unwrap()],
        &[("REDISCHED_DISPATCH__TTR_MS", "2000")],
    );
    let _ = std::fs::remove_file(&file);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&json["dispatch"]["batch"], &json["dispatch"]["ttr_ms"]),
        (&Value::from(7), &Value::from(2000))
    );
    assert_eq!(json["log"]["format"], "json");
    let out = cli.run(&["check-config", "--config", "/no/such/redisched.toml"]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
}

#[test]
fn check_config_ignores_kubernetes_service_variables_and_names_them_once() {
    let cli = Cli::new();
    let k8s = [
        ("REDISCHED_PORT", "tcp://10.96.0.12:7171"),
        ("REDISCHED_SERVICE_HOST", "10.96.0.12"),
        ("REDISCHED_SERVICE_PORT", "7171"),
        ("REDISCHED_PORT_7171_TCP_PROTO", "tcp"),
    ];
    let out = cli.run_env(&["check-config", "--json"], &k8s);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "one warning line: {stderr}");
    assert!(
        stderr.starts_with("warning: ")
            && stderr.contains(
                "REDISCHED_PORT, REDISCHED_PORT_7171_TCP_PROTO, REDISCHED_SERVICE_HOST, REDISCHED_SERVICE_PORT"
            ),
        "{stderr}"
    );
    let config: Value = serde_json::from_slice(&out.stdout).expect("json config");
    assert!(config.get("port").is_none());

    // A misspelled key inside a known section still fails, naming the key.
    let mut typo = k8s.to_vec();
    typo.push(("REDISCHED_REDIS__ULR", "redis://127.0.0.1:6379"));
    let out = cli.run_env(&["check-config"], &typo);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ulr"),
        "{}",
        describe(&out)
    );
}

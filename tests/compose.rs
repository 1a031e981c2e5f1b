//! `docker-compose.yml` and the `Dockerfile` checked without a Docker engine: the compose
//! file validates with `docker-compose config -q`, has the persistence and health
//! settings the issue asks for, publishes its ports on 127.0.0.1 from helper variables, and
//! every `REDISCHED_*` variable in it loads through the real config loader into the key its
//! name says (so renaming a config key cannot silently leave the compose file behind).
//! The stack itself is built and started for real by `scripts/compose-test.sh` (in `.ci/run`).

use std::path::Path;
use std::process::Command;

use redisched::config::Config;

fn read(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `REDISCHED_*` variables of the compose file, as `(name, value)`, with
/// `${VAR:-default}` resolved to its default. Accepts both the map form
/// (`NAME: value`) and the list form (`- NAME=value`).
fn redisched_env(compose: &str) -> Vec<(String, String)> {
    let mut vars = Vec::new();
    for line in compose.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let entry = line
            .strip_prefix("- ")
            .unwrap_or(line)
            .trim_matches(['"', '\'']);
        if !entry.starts_with("REDISCHED_") {
            continue;
        }
        let (name, value) = entry
            .split_once(": ")
            .or_else(|| entry.split_once('='))
            .or_else(|| entry.strip_suffix(':').map(|n| (n, "")))
            .unwrap_or_else(|| panic!("cannot read the compose env line {line:?}"));
        let value = value.trim().trim_matches(['"', '\'']);
        vars.push((name.trim().to_string(), interpolate(value)));
    }
    vars
}

/// Compose's `${VAR:-default}` / `${VAR-default}` -> default (the tests do not set VAR).
fn interpolate(value: &str) -> String {
    let Some(start) = value.find("${") else {
        return value.to_string();
    };
    let end = start + value[start..].find('}').expect("closing brace");
    let inner = &value[start + 2..end];
    let default = inner
        .split_once(":-")
        .or_else(|| inner.split_once('-'))
        .map(|(_, d)| d)
        .unwrap_or_else(|| {
            panic!("{value:?}: give ${{VAR}} a default so the stack starts without it")
        });
    format!(
        "{}{}{}",
        &value[..start],
        default,
        interpolate(&value[end + 1..])
    )
}

#[test]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
fn every_redisched_variable_in_compose_loads_into_its_config_key() {
    let compose = read("docker-compose.yml");
    let vars = redisched_env(&compose);
    for required in [
        "REDISCHED_REDIS__URL",
        "REDISCHED_AMQP__URL",
        "REDISCHED_HTTP__LISTEN",
        "REDISCHED_HTTP__TOKEN",
    ] {
        assert!(
            vars.iter().any(|(n, _)| n == required),
            "docker-compose.yml sets {required}"
        );
    }
    figment::Jail::expect_with(|jail| {
        // Nothing from the test environment may leak in (e.g. TEST_REDIS_URL).
        jail.clear_env();
        for (name, value) in &vars {
            jail.set_env(name, value);
        }
        let config = Config::from_figment(Config::figment(None))
            .unwrap_or_else(|e| panic!("the compose environment must load: {e}"));
        let tree = serde_json::to_value(&config).expect("config as JSON");
        for (name, value) in &vars {
            let path: Vec<String> = name["REDISCHED_".len()..]
                .split("__")
                .map(|part| part.to_ascii_lowercase())
                .collect();
            let pointer = format!("/{}", path.join("/"));
            let loaded = tree
                .pointer(&pointer)
                .unwrap_or_else(|| panic!("{name} names no config key ({pointer})"));
            let loaded = match loaded {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            assert_eq!(&loaded, value, "{name} lands in {}", path.join("."));
        }
        assert_eq!(config.http.listen, "0.0.0.0:7171");
        assert!(
            !config.http.token.is_empty(),
            "a public listen address needs a token"
        );
        Ok(())
    });
}

#[test]
fn the_env_scanner_reads_both_compose_forms() {
    let vars = redisched_env(
        "    environment:\n      REDISCHED_A__B: \"x\"\n      - REDISCHED_C=${T:-tok}\n      # REDISCHED_D: no\n      OTHER: 1\n",
    );
    assert_eq!(
        vars,
        [
            ("REDISCHED_A__B".to_string(), "x".to_string()),
            ("REDISCHED_C".to_string(), "tok".to_string())
        ]
    );
}

#[test]
fn compose_file_has_persistence_health_checks_and_volumes() {
    let compose = read("docker-compose.yml");
    for needle in [
        "--appendonly",
        "--appendfsync",
        "everysec",
        "--maxmemory-policy",
        "noeviction",
        "-management",
        "condition: service_healthy",
        // RabbitMQ is healthy when its listeners accept connections, not when the node answers
        "check_port_connectivity",
        "redis-data:/data",
        "rabbitmq-data:/var/lib/rabbitmq",
        "/readyz",
    ] {
        assert!(
            compose.contains(needle),
            "docker-compose.yml should contain {needle:?}"
        );
    }
    assert_eq!(
        compose.matches("healthcheck:").count(),
        3,
        "a healthcheck per service"
    );
    assert_eq!(compose.matches("condition: service_healthy").count(), 2);
    assert!(
        !compose.contains(r#""-q", "ping""#),
        "`rabbitmq-diagnostics ping` passes before the node accepts connections"
    );
    let volumes = compose
        .split("\nvolumes:\n")
        .nth(1)
        .expect("top-level volumes");
    assert!(volumes.contains("redis-data:") && volumes.contains("rabbitmq-data:"));

    let dockerfile = read("Dockerfile");
    let stages: Vec<&str> = dockerfile
        .lines()
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert_eq!(stages.len(), 2, "multi-stage Dockerfile: {stages:?}");
    assert!(stages[0].contains(" AS build"));
    assert!(dockerfile.contains("COPY --from=build"));
    assert!(dockerfile.contains("--locked"));
}

#[test]
fn docker_compose_validates_the_file() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let attempts: [&[&str]; 2] = [&["docker-compose"], &["docker", "compose"]];
    for program in attempts {
        let mut cmd = Command::new(program[0]);
        cmd.args(&program[1..])
            .args(["-f", "docker-compose.yml", "config", "-q"])
            .current_dir(dir)
            .env_remove("REDISCHED_HTTP__TOKEN");
        let Ok(out) = cmd.output() else { continue };
        let stderr = String::from_utf8_lossy(&out.stderr);
        if program.len() == 2 && !out.status.success() && stderr.contains("unknown") {
            continue; // `docker` without the compose plugin
        }
        assert!(out.status.success(), "{program:?} config -q: {stderr}");
        return;
    }
    panic!("neither docker-compose nor `docker compose` is installed: run scripts/browser-deps.sh (installs Debian's docker-compose)");
}

/// `ports:` entries of the compose file, quotes removed.
fn published_ports(compose: &str) -> Vec<String> {
    let mut entries = Vec::new();
    let mut in_ports = false;
    for line in compose.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        if line == "ports:" {
            in_ports = true;
        } else if let Some(entry) = line.strip_prefix("- ").filter(|_| in_ports) {
            entries.push(entry.trim_matches(['"', '\'']).to_string());
        } else {
            in_ports = false;
        }
    }
    entries
}

/// Names of the `${NAME...}` variables a text reads.
fn variables(text: &str) -> Vec<&str> {
    text.split("${")
        .skip(1)
        .map(|rest| {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

#[test]
fn ports_are_published_on_loopback_by_default_from_helper_variables() {
    let compose = read("docker-compose.yml");
    let ports = published_ports(&compose);
    assert_eq!(
        ports.len(),
        3,
        "AMQP, RabbitMQ management and the HTTP API: {ports:?}"
    );
    for entry in &ports {
        let resolved = interpolate(entry);
        let parts: Vec<&str> = resolved.split(':').collect();
        assert_eq!(parts.len(), 3, "{entry}: address:host port:container port");
        assert_eq!(
            parts[0], "127.0.0.1",
            "{entry} listens on loopback by default"
        );
        let host_port = entry.split(':').nth(1).unwrap_or_default();
        assert!(
            entry.contains("${HOST_PORT_"),
            "{entry}: the host port comes from a HOST_PORT_* variable (got {host_port:?})"
        );
    }
    // Helper variables must stay out of the config loader's prefix: it refuses unknown
    // REDISCHED_* variables, and the bridge container would see them if passed through.
    let config_vars: Vec<String> = redisched_env(&compose)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    for name in variables(&compose) {
        assert!(
            !name.starts_with("REDISCHED_") || config_vars.iter().any(|v| v == name),
            "${{{name}}} starts with REDISCHED_ but is no config key the bridge gets"
        );
    }
    assert_eq!(
        variables("a ${HOST_PORT_AMQP:-5672}:5672 ${B}"),
        ["HOST_PORT_AMQP", "B"]
    );
}

#[test]
fn the_release_profile_ships_without_debug_info() {
    let manifest: toml::Table = read("Cargo.toml").parse().expect("Cargo.toml parses");
    let profile = |name: &str| {
        manifest["profile"][name]
            .as_table()
            .unwrap_or_else(|| panic!("[profile.{name}]"))
            .clone()
    };
    let release = profile("release");
    let debug = release.get("debug").map(ToString::to_string);
    assert!(
        matches!(debug.as_deref(), Some("0" | "false" | "\"none\"")),
        "release debug = {debug:?}: the shipped binary carries no debug info"
    );
    // symbols for profiling live in their own profile
    let profiling = profile("profiling");
    assert_eq!(profiling["inherits"].as_str(), Some("release"));
}

#[test]
fn ci_runs_the_real_compose_test_between_the_tests_and_the_benchmark() {
    let ci = read(".ci/run");
    let at = |needle: &str| {
        ci.find(needle)
            .unwrap_or_else(|| panic!(".ci/run runs {needle}"))
    };
    let (tests, compose, bench) = (
        at("scripts/test.sh"),
        at("scripts/compose-test.sh"),
        at("redisched-bench"),
    );
    assert!(tests < compose && compose < bench);
}

//! `redisched check` (the store's invariants and the Redis server's own state) and
//! `redisched check-config` (the merged configuration, redacted).

use std::path::Path;

use serde_json::json;

use crate::config::Config;
use crate::job::Topic;
use crate::store::{CheckReport, HealthView, Store};

use super::output::Output;
use super::CliError;

/// What `check-config` warns of on stderr, its exit code unchanged: signing secrets that
/// have expired or expire within [`crate::targets::EXPIRY_WARNING`], by target and key.
/// Empty when the configuration does not load (the command then fails naming the key).
pub fn config_warnings(file: Option<&Path>) -> Vec<String> {
    Config::load(file).map_or_else(
        |_| Vec::new(),
        |config| crate::targets::secret_warnings(&config.targets, std::time::SystemTime::now()),
    )
}

pub(super) fn check_config(file: Option<&Path>, as_json: bool) -> Result<Output, CliError> {
    let config = Config::load(file)?.redacted();
    let json = serde_json::to_value(&config).map_err(|e| CliError::Failed(e.to_string()))?;
    let human = if as_json {
        serde_json::to_string_pretty(&json).map_err(|e| CliError::Failed(e.to_string()))?
    } else {
        toml::to_string_pretty(&config).map_err(|e| CliError::Failed(e.to_string()))?
    };
    Ok(Output { json, human })
}

pub(super) async fn check(
    store: &Store,
    topic: Option<&Topic>,
    repair: bool,
    allow_eviction: bool,
) -> Result<Output, CliError> {
    let topics = match topic {
        Some(topic) => vec![topic.clone()],
        None => store.topics().await?,
    };
    let mut reports = Vec::with_capacity(topics.len());
    for topic in &topics {
        reports.push(store.check(topic, repair).await?);
    }
    let found: usize = reports.iter().map(|r| r.problems.len()).sum();
    let unrepaired: usize = reports.iter().map(|r| r.unrepaired()).sum();
    let examined: u64 = reports.iter().map(|r| r.examined).sum();
    // The server itself: a policy that may evict jobs, or a full memory, is a problem
    // no repair fixes (exit 6 like the others); an unreadable policy is only said.
    store.probe_health().await?;
    let health = store.health().view();
    let (redis_problems, redis_line) = redis_verdict(&health, allow_eviction);
    let json = json!({
        "repair": repair,
        "topics": reports,
        "examined": examined,
        "problems": found + redis_problems.len(),
        "unrepaired": unrepaired + redis_problems.len(),
        "redis": {
            "eviction_policy": health.eviction_policy,
            "eviction_policy_ok": health.eviction_policy_ok,
            "eviction_allowed": allow_eviction,
            "evicted_keys": health.evicted_keys,
            "oom": health.oom.is_some(),
            "used_memory": health.used_memory,
            "maxmemory": health.maxmemory,
            "unknown_reason": health.unknown_reason,
            "nodes": health.nodes,
            "problems": redis_problems,
        },
    });
    let human = check_human(&reports, &health, &redis_line, &redis_problems, repair);
    let output = Output { json, human };
    if unrepaired > 0 || !redis_problems.is_empty() {
        return Err(CliError::Problems(Box::new(output)));
    }
    Ok(output)
}

/// What `check` says of the Redis server itself: the problems no repair fixes, and the
/// line naming its eviction policy.
fn redis_verdict(health: &HealthView, allow_eviction: bool) -> (Vec<String>, String) {
    let mut redis_problems = Vec::new();
    if health.eviction_policy_ok == Some(false) && !allow_eviction {
        redis_problems.push(format!(
            "maxmemory-policy {} may evict scheduled jobs: set maxmemory-policy noeviction, or redis.allow_eviction = true to accept the risk",
            health.eviction_policy
        ));
    }
    if let Some(oom) = &health.oom {
        redis_problems.push(format!("out of memory, Redis refuses writes: {oom}"));
    }
    let redis_line = match (&health.eviction_policy_ok, &health.unknown_reason) {
        (Some(true), _) => format!(
            "redis: maxmemory-policy {} keeps jobs",
            health.eviction_policy
        ),
        (Some(false), _) if allow_eviction => format!(
            "redis: maxmemory-policy {} may evict scheduled jobs (allowed by redis.allow_eviction)",
            health.eviction_policy
        ),
        (Some(false), _) => format!("redis: maxmemory-policy {}", health.eviction_policy),
        (None, why) => format!(
            "redis: maxmemory-policy unknown ({}); make sure it is noeviction",
            why.as_deref().unwrap_or("not readable")
        ),
    };
    (redis_problems, redis_line)
}

/// `check`'s report for people: the server's line, then each topic with its problems.
fn check_human(
    reports: &[CheckReport],
    health: &HealthView,
    redis_line: &str,
    redis_problems: &[String],
    repair: bool,
) -> String {
    let found: usize = reports.iter().map(|r| r.problems.len()).sum();
    let unrepaired: usize = reports.iter().map(|r| r.unrepaired()).sum();
    let examined: u64 = reports.iter().map(|r| r.examined).sum();
    let mut human = String::new();
    human.push_str(redis_line);
    if let Some(evicted) = health.evicted_keys.filter(|&n| n > 0) {
        human.push_str(&format!(
            "; it has evicted {evicted} key(s) since it started (INFO evicted_keys)"
        ));
    }
    human.push('\n');
    for problem in redis_problems {
        human.push_str(&format!("  redis problem: {problem}\n"));
    }
    for report in reports {
        human.push_str(&format!(
            "{}: {} entries, {} problem(s){}\n",
            report.topic,
            report.examined,
            report.problems.len(),
            if report.damaged > 0 {
                format!(", {} entries set aside in its damaged hash", report.damaged)
            } else {
                String::new()
            }
        ));
        for p in &report.problems {
            human.push_str(&format!(
                "  {:<17} {:<24} {}{}\n",
                p.kind,
                p.id,
                p.detail,
                if p.repaired { "  [repaired]" } else { "" }
            ));
        }
    }
    human.push_str(&format!(
        "{} topic(s), {examined} entries checked: {}",
        reports.len(),
        match (found, unrepaired) {
            (0, _) => "the store is sound".to_string(),
            (n, 0) => format!("{n} problem(s), all repaired"),
            (n, u) if repair => format!("{n} problem(s), {u} not repaired"),
            (n, _) => format!("{n} problem(s); run with --repair to fix them"),
        }
    ));
    if !redis_problems.is_empty() {
        human.push_str(&format!("; {} Redis problem(s)", redis_problems.len()));
    }
    human
}

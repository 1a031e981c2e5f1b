//! What a report needs beside the figures, so docs can be written from the output
//! alone: when it ran (UTC), on which commit, how loaded the machine was at start and
//! end, which Redis and RabbitMQ; and, for `all --runs N`, every figure of the rounds
//! as median (min–max).

use std::time::{Duration, SystemTime};

use serde_json::{json, Map, Value};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::common::{self, Spread};

/// The run's context, taken at its start; `finish` adds the end.
pub(super) struct RunContext {
    started: SystemTime,
    load_start: Value,
    git_commit: String,
    git_dirty: Option<bool>,
    redis_version: String,
    rabbitmq_version: String,
}

impl RunContext {
    /// Never fails: what cannot be found is recorded as "unknown".
    pub(super) async fn start(redis_url: &str, amqp_url: &str) -> Self {
        Self {
            started: SystemTime::now(),
            load_start: common::load_average(),
            git_commit: git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into()),
            // Tracked files changed since that commit (the binary may hold them).
            git_dirty: git(&["status", "--porcelain", "--untracked-files=no"])
                .map(|changes| !changes.is_empty()),
            redis_version: redis_version(redis_url)
                .await
                .unwrap_or_else(|| "unknown".into()),
            rabbitmq_version: rabbitmq_version(amqp_url)
                .await
                .unwrap_or_else(|| "unknown".into()),
        }
    }

    pub(super) fn finish(&self) -> Value {
        let utc = |t: SystemTime| humantime::format_rfc3339_seconds(t).to_string();
        json!({
            "started_utc": utc(self.started),
            "ended_utc": utc(SystemTime::now()),
            "git_commit": self.git_commit,
            "git_dirty": self.git_dirty,
            "load_average": { "start": self.load_start, "end": common::load_average() },
            "versions": {
                "redis": self.redis_version,
                "rabbitmq": self.rabbitmq_version,
                "redisched_bench": env!("CARGO_PKG_VERSION"),
            },
        })
    }
}

/// `git <args>` in the working directory, trimmed; `None` if git or the repo is absent.
fn git(args: &[&str]) -> Option<String> {
    let output = std::process::Command::new("git").args(args).output().ok()?;
    if !output.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// `redis_version` of `INFO server`.
async fn redis_version(url: &str) -> Option<String> {
    let client = redis::Client::open(url).ok()?;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(|v| v.trim().to_string())
}

/// The broker's `version` server property, read from the `connection.start` it sends
/// to a new plain-AMQP connection (lapin does not expose it); the connection is then
/// dropped before any login.
async fn rabbitmq_version(amqp_url: &str) -> Option<String> {
    let first = amqp_url.split(',').next()?.trim();
    let url = url::Url::parse(first).ok()?;
    if url.scheme() != "amqp" {
        return None;
    }
    let address = (url.host_str()?.to_string(), url.port().unwrap_or(5672));
    let exchange = async {
        let mut socket = tokio::net::TcpStream::connect(address).await.ok()?;
        socket.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
        // Frame: type (1), channel (2), payload size (4), payload, end marker.
        let mut header = [0u8; 7];
        socket.read_exact(&mut header).await.ok()?;
        let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
        if header[0] != 1 || size > 1 << 20 {
            return None;
        }
        let mut payload = vec![0u8; size];
        socket.read_exact(&mut payload).await.ok()?;
        Some(payload)
    };
    let payload = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()??;
    let (_, class) = lapin::protocol::parse_class(payload.as_slice()).ok()?;
    let lapin::protocol::AMQPClass::Connection(lapin::protocol::connection::AMQPMethod::Start(
        start,
    )) = class
    else {
        return None;
    };
    match start.server_properties.inner().get("version")? {
        lapin::types::AMQPValue::LongString(v) => {
            Some(String::from_utf8_lossy(v.as_bytes()).into_owned())
        }
        lapin::types::AMQPValue::ShortString(v) => Some(v.as_str().to_string()),
        _ => None,
    }
}

/// Every figure of `rounds` (reports of the same shape) as median (min–max): numbers
/// become `{median, min, max, runs}`; a figure that already is such a spread (several
/// passes inside a round) counts with its median; objects and arrays of objects (one
/// per rate, per publisher count…) are merged field by field and item by item; arrays
/// of numbers (time series, CDFs, load averages) are left to the rounds.
pub(super) fn summary(rounds: &[Value]) -> Value {
    let all: Vec<&Value> = rounds.iter().collect();
    merge(&all).unwrap_or(Value::Null)
}

fn is_spread(value: &Value) -> bool {
    ["median", "min", "max", "runs"]
        .iter()
        .all(|k| value.get(k).is_some_and(Value::is_number))
}

fn merge(values: &[&Value]) -> Option<Value> {
    let first = *values.first()?;
    match first {
        Value::Number(_) => {
            let numbers: Vec<f64> = values.iter().filter_map(|v| v.as_f64()).collect();
            Spread::of(&numbers).map(|s| s.to_json(3))
        }
        Value::Object(_) if is_spread(first) => {
            let medians: Vec<f64> = values.iter().filter_map(|v| v["median"].as_f64()).collect();
            Spread::of(&medians).map(|s| s.to_json(3))
        }
        Value::Object(fields) => {
            let mut merged = Map::new();
            for key in fields.keys() {
                let of_key: Vec<&Value> = values
                    .iter()
                    .filter_map(|v| v.get(key))
                    .filter(|v| !v.is_null())
                    .collect();
                if let Some(value) = merge(&of_key) {
                    merged.insert(key.clone(), value);
                }
            }
            Some(Value::Object(merged))
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object) => {
            let merged: Vec<Value> = (0..items.len())
                .filter_map(|i| {
                    let of_item: Vec<&Value> = values.iter().filter_map(|v| v.get(i)).collect();
                    merge(&of_item)
                })
                .collect();
            Some(Value::Array(merged))
        }
        Value::Array(_) => None,
        _ => Some(first.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_takes_median_and_range_of_every_figure() {
        let rounds = vec![
            json!({"dispatch": {"jobs_per_s": 100.0, "series": [[0, 1]], "what": "x"},
                   "precision": {"rates": [{"rate_per_s": 1000, "p99": 4.0}]},
                   "history": {"median": 0.9, "min": 0.8, "max": 1.0, "runs": 3}}),
            json!({"dispatch": {"jobs_per_s": 300.0, "series": [[0, 2]], "what": "x"},
                   "precision": {"rates": [{"rate_per_s": 1000, "p99": 9.0}]},
                   "history": {"median": 1.1, "min": 1.0, "max": 1.2, "runs": 3}}),
            json!({"dispatch": {"jobs_per_s": 200.0, "series": [[0, 3]], "what": "x"},
                   "precision": {"rates": [{"rate_per_s": 1000, "p99": 5.0}]},
                   "history": {"median": 1.0, "min": 0.9, "max": 1.1, "runs": 3}}),
        ];
        let s = summary(&rounds);
        assert_eq!(
            s["dispatch"]["jobs_per_s"],
            json!({"median": 200.0, "min": 100.0, "max": 300.0, "runs": 3})
        );
        assert!(s["dispatch"].get("series").is_none());
        assert_eq!(s["dispatch"]["what"], "x");
        assert_eq!(s["precision"]["rates"][0]["p99"]["median"], 5.0);
        assert_eq!(s["precision"]["rates"][0]["rate_per_s"]["max"], 1000.0);
        assert_eq!(
            s["history"],
            json!({"median": 1.0, "min": 0.9, "max": 1.1, "runs": 3})
        );
    }

    #[test]
    fn summary_of_a_figure_missing_in_some_rounds_counts_the_others() {
        let rounds = vec![json!({"a": 1.0}), json!({"a": null}), json!({"a": 3.0})];
        assert_eq!(summary(&rounds)["a"]["runs"], 2);
    }
}

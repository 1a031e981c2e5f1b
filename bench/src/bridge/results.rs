//! The results of record: `all` (not `--quick`) saves each run's rounds as
//! `bench/results/<UTC start>-<commit>.json`, so `report` can rebuild the performance
//! page's table from files kept in the repository. Every figure of every round is
//! kept; time series, CDFs, a scenario's own inner rounds (summarised beside them) and
//! the long descriptions of what a figure is (documented where it is measured) are
//! left to the full report, `artifacts/bench.json`. Commit the files the page's table
//! cites (its `Source:` lines) with the page.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

/// Bumped when a results file's shape changes in a way `report` must know about.
const FORMAT: u64 = 1;

/// Arrays of plain values longer than this are series or CDFs, left to the full report.
const LONGEST_KEPT_ARRAY: usize = 8;

/// Longer strings are descriptions of a figure, not figures.
const LONGEST_KEPT_TEXT: usize = 100;

/// `bench/results` of this checkout (or of the bench crate when run from elsewhere).
pub(super) fn default_dir() -> PathBuf {
    if Path::new("bench/Cargo.toml").exists() {
        return PathBuf::from("bench/results");
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("results")
}

/// The results file of a full `all` report: its context and its rounds, slimmed.
pub(super) fn of_report(report: &Value) -> Value {
    let rounds: Vec<Value> = report["rounds"]
        .as_array()
        .map(|rounds| rounds.iter().map(slim).collect())
        .unwrap_or_default();
    json!({
        "results_format": FORMAT,
        "command": report["command"],
        "quick": report["quick"],
        "runs": rounds.len(),
        "machine": report["machine"],
        "context": report["context"],
        "total_seconds": report["total_seconds"],
        "rounds": rounds,
    })
}

/// One round without what only the full report needs: time series and CDFs (and any
/// long array of plain values), inner `rounds`, long descriptions.
pub(super) fn slim(value: &Value) -> Value {
    match value {
        Value::Object(fields) => {
            let kept: Map<String, Value> = fields
                .iter()
                .filter(|(key, v)| !left_out(key, v))
                .map(|(k, v)| (k.clone(), slim(v)))
                .collect();
            Value::Object(kept)
        }
        Value::Array(items) => Value::Array(items.iter().map(slim).collect()),
        other => other.clone(),
    }
}

fn left_out(key: &str, value: &Value) -> bool {
    let series = value.as_array().is_some_and(|items| {
        items.len() > LONGEST_KEPT_ARRAY && !items.iter().any(Value::is_object)
    });
    let description = value.as_str().is_some_and(|t| t.len() > LONGEST_KEPT_TEXT);
    series || description || key == "series" || key.starts_with("cdf") || key == "rounds"
}

/// `<started UTC, minutes>-<commit>[-dirty].json`: names sort by start.
pub(super) fn file_name(results: &Value) -> String {
    let context = &results["context"];
    let started: String = context["started_utc"]
        .as_str()
        .unwrap_or("unknown")
        .chars()
        .take(16)
        .map(|c| if c == ':' { '-' } else { c })
        .collect();
    let commit = context["git_commit"].as_str().unwrap_or("unknown");
    let dirty = if context["git_dirty"].as_bool() == Some(true) {
        "-dirty"
    } else {
        ""
    };
    format!("{started}Z-{commit}{dirty}.json")
}

/// Writes `results` into `dir`; returns the file's path.
pub(super) fn save(results: &Value, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let path = dir.join(file_name(results));
    let mut text = serde_json::to_string_pretty(results)?;
    text.push('\n');
    std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    Ok(path)
}

/// A results file read back.
#[derive(Debug)]
pub(super) struct Results {
    pub path: PathBuf,
    pub value: Value,
}

impl Results {
    pub(super) fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let value: Value =
            serde_json::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        if value["rounds"].as_array().is_none_or(|r| r.is_empty()) {
            bail!(
                "{} has no rounds: `report` reads what `all` writes (bench/results/*.json, or artifacts/bench.json)",
                path.display()
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            value,
        })
    }

    pub(super) fn rounds(&self) -> &[Value] {
        self.value["rounds"].as_array().map_or(&[], Vec::as_slice)
    }

    /// When the run started (RFC 3339, UTC), for ordering.
    pub(super) fn started(&self) -> &str {
        self.value["context"]["started_utc"].as_str().unwrap_or("")
    }
}

/// Every full (not `--quick`) results file in `dir`, newest first.
pub(super) fn in_dir(dir: &Path) -> Result<Vec<Results>> {
    let entries = std::fs::read_dir(dir).with_context(|| {
        format!(
            "read {} (run `target/release/redisched-bench all --runs 3` first)",
            dir.display()
        )
    })?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            let results = Results::read(&path)?;
            if results.value["quick"].as_bool() != Some(true) {
                found.push(results);
            }
        }
    }
    newest_first(&mut found);
    Ok(found)
}

pub(super) fn newest_first(results: &mut [Results]) {
    results.sort_by(|a, b| b.started().cmp(a.started()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_results_file_keeps_the_figures_and_drops_the_series() {
        let series: Vec<Value> = (0..50).map(|i| json!([i, i * 10])).collect();
        let report = json!({
            "command": "target/release/redisched-bench all --runs 2",
            "quick": false,
            "context": {"started_utc": "2026-12-05T10:34:56Z", "git_commit": "45b44b4", "git_dirty": false},
            "summary": {"dispatch": {"jobs_per_s": {"median": 1.0}}},
            "dispatch": {"bridge": {"jobs_per_s": 9.0}},
            "rounds": [
                {"dispatch": {"bridge": {"jobs_per_s": 9.0, "series": series},
                              "ceiling": {"what": "w".repeat(101), "msgs_per_s": 12.0},
                              "best_publisher": {"trials": [{"publishers": 1, "msgs_per_s": 5.0}]},
                              "load_average": [1.0, 2.0, 3.0]},
                 "precision": {"rates": [{"rate_per_s": 1000, "cdf": [[1.0, 0.5]]}]},
                 "webhook": {"throughput": {"ratio": {"median": 0.5}, "rounds": [{"ratio": 0.5}]}}},
                {"dispatch": {"bridge": {"jobs_per_s": 11.0}}},
            ],
        });
        let results = of_report(&report);
        assert_eq!(results["runs"], 2);
        assert!(results.get("summary").is_none() && results.get("dispatch").is_none());
        let first = &results["rounds"][0]["dispatch"];
        assert_eq!(first["bridge"]["jobs_per_s"], 9.0);
        assert!(first["bridge"].get("series").is_none());
        assert!(first["ceiling"].get("what").is_none());
        assert_eq!(first["ceiling"]["msgs_per_s"], 12.0);
        let round = &results["rounds"][0];
        assert_eq!(round["precision"]["rates"][0], json!({"rate_per_s": 1000}));
        assert_eq!(
            round["webhook"]["throughput"],
            json!({"ratio": {"median": 0.5}})
        );
        assert_eq!(first["best_publisher"]["trials"][0]["msgs_per_s"], 5.0);
        assert_eq!(first["load_average"], json!([1.0, 2.0, 3.0]));
        assert_eq!(file_name(&results), "2026-12-05T10-34Z-45b44b4.json");
    }

    #[test]
    fn saved_files_are_read_back_newest_first_and_quick_runs_are_left_out() {
        let dir = std::env::temp_dir().join(format!("bench-results-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let run = |started: &str, commit: &str, quick: bool| {
            json!({"quick": quick, "context": {"started_utc": started, "git_commit": commit},
                   "rounds": [{"dispatch": {}}]})
        };
        for (started, commit, quick) in [
            ("2026-12-01T08:00:00Z", "aaaaaaa", false),
            ("2026-12-03T08:00:00Z", "ccccccc", true),
            ("2026-12-02T08:00:00Z", "bbbbbbb", false),
        ] {
            save(&run(started, commit, quick), &dir).expect("save");
        }
        let found = in_dir(&dir).expect("read");
        let _ = std::fs::remove_dir_all(&dir);
        let commits: Vec<&str> = found
            .iter()
            .map(|r| r.value["context"]["git_commit"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(commits, ["bbbbbbb", "aaaaaaa"]);
    }
}

//! The peer: BullMQ on the same Redis (`bench/peer/bullmq.mjs`, run with Node).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub(super) struct Params {
    pub jobs: u64,
    pub rates: Vec<u64>,
    pub seconds: f64,
    pub max_delay_ms: u64,
    pub warm_up_ms: u64,
    pub body_bytes: usize,
    pub redis_url: String,
}

/// `bench/peer` of this checkout (or of the working directory).
pub(super) fn dir() -> PathBuf {
    let here = Path::new("bench/peer");
    if here.join("bullmq.mjs").exists() {
        return here.to_path_buf();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("peer")
}

/// Runs the script and returns its JSON report. Fails with a hint if `npm ci` was not run.
pub(super) async fn run(params: &Params) -> Result<Value> {
    let dir = dir();
    if !dir.join("node_modules/bullmq").exists() {
        bail!(
            "BullMQ is not installed: run `npm ci --prefix {}` (Node 20)",
            dir.display()
        );
    }
    let rates: Vec<String> = params.rates.iter().map(u64::to_string).collect();
    eprintln!(
        "peer: BullMQ, {} delayed jobs, rates {:?}/s",
        params.jobs, params.rates
    );
    let mut command = Command::new("node");
    command
        .arg(dir.join("bullmq.mjs"))
        .arg("--json")
        .args(["--jobs", &params.jobs.to_string()])
        .args(["--rates", &rates.join(",")])
        .args(["--seconds", &params.seconds.to_string()])
        .args(["--max-delay-ms", &params.max_delay_ms.to_string()])
        .args(["--warm-up-ms", &params.warm_up_ms.to_string()])
        .args(["--body-bytes", &params.body_bytes.to_string()])
        .args(["--redis", &params.redis_url])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let output = tokio::task::spawn_blocking(move || command.output())
        .await?
        .context("run node (is Node 20 installed?)")?;
    if !output.status.success() {
        bail!("the BullMQ script failed: {}", output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON from the BullMQ script")?;
    serde_json::from_str(line).context("parse the BullMQ script's JSON")
}

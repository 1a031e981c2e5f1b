//! What redisched's integration tests (`tests/common` re-exports it) and `redisched-bench`
//! both need against the real services: names no other run uses, cleanup of a key
//! prefix, the depth of a queue, and `redisched run` as a child process.
#![forbid(unsafe_code)]
#![warn(clippy::too_many_lines, clippy::let_underscore_must_use)]

use std::io;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::Channel;
use redisched::config::Config;

/// A name no other run (or earlier run) uses: `<label>-<pid>-<time>-<n>`.
pub fn unique(label: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{label}-{}-{:x}-{}",
        std::process::id(),
        nanos & 0xffff_ffff,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Names everything the bridge of `config` creates (key prefix, exchanges, queues) after
/// `name`, so runs sharing the services never meet.
pub fn isolate(config: &mut Config, name: &str) {
    config.redis.prefix = name.to_string();
    config.amqp.commands_exchange = format!("{name}.commands");
    config.amqp.commands_queue = format!("{name}.commands");
    config.amqp.invalid_exchange = format!("{name}.invalid");
    config.amqp.invalid_queue = format!("{name}.invalid");
    config.amqp.expired_exchange = format!("{name}.expired");
    config.amqp.expired_queue = format!("{name}.expired");
    config.amqp.ready_exchange = format!("{name}.ready");
}

/// Deletes every key under `prefix:` (SCAN + UNLINK) and returns how many. Synchronous
/// so that `Drop` implementations can call it.
pub fn delete_prefix(redis_url: &str, prefix: &str) -> redis::RedisResult<u64> {
    let client = redis::Client::open(redis_url)?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(5))?;
    let mut cursor: u64 = 0;
    let mut deleted = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query(&mut conn)?;
        if !keys.is_empty() {
            let n: u64 = redis::cmd("UNLINK").arg(&keys).query(&mut conn)?;
            deleted += n;
        }
        if next == 0 {
            return Ok(deleted);
        }
        cursor = next;
    }
}

/// Messages ready in a queue (passive declare: fails if the queue does not exist).
pub async fn queue_depth(channel: &Channel, queue: &str) -> lapin::Result<u32> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await?;
    Ok(declared.message_count())
}

/// A `redisched run` child process configured by `config` alone (its environment);
/// killed on drop if still running.
#[derive(Debug)]
pub struct ChildBridge {
    pub child: Child,
}

impl ChildBridge {
    /// Starts `bin run` with every setting of `config` as `REDISCHED_*` variables.
    pub fn spawn(bin: &Path, config: &Config, stdout: Stdio, stderr: Stdio) -> io::Result<Self> {
        let child = Command::new(bin)
            .arg("run")
            .envs(config.to_env())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()?;
        Ok(Self { child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL (no chance to clean up), then reap.
    pub fn kill9(&mut self) {
        // It may have exited already: then there is nothing to kill, and wait reaps it.
        self.child.kill().ok();
        self.child.wait().ok();
    }

    /// SIGTERM (graceful stop) and wait up to `within`. Returns the exit status and how
    /// long the stop took, or `None` if it was still running (it is then killed).
    pub fn terminate(&mut self, within: Duration) -> io::Result<Option<(ExitStatus, Duration)>> {
        let started = Instant::now();
        // std has no SIGTERM without `unsafe` (libc); kill(1) sends it.
        Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()?;
        while started.elapsed() < within {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Some((status, started.elapsed())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
        Ok(None)
    }
}

impl Drop for ChildBridge {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill9();
        }
    }
}

/// The nearest-rank `p`-quantile (`0.0..=1.0`) of `sorted` (ascending): the smallest value
/// with at least `p` of the values at or below it. The default (0) for no values, so a
/// figure line can still be printed. The one definition behind every p50/p99 the tests
/// assert and the benchmark reports.
pub fn percentile<T: Copy + Default>(sorted: &[T], p: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// A private `redis-server` (Debian package redis-server) on `127.0.0.1:port`, its files
/// and `redis.log` in `dir`, no RDB snapshots, output discarded: the one way the tests and
/// the bench start a server of their own (the shared test Redis cannot give a crash, a
/// replica, a cluster or counters no other client moves). The caller adds what its run
/// needs (`--appendonly`, `--replicaof`, `--cluster-enabled` …) and spawns it.
pub fn redis_server(port: u16, dir: &Path) -> Command {
    let mut command = Command::new("redis-server");
    command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", ""])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

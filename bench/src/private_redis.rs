//! A `redis-server` child of the bench, on a free port, for the figures the shared Redis
//! cannot give honestly: `used_memory` and `INFO commandstats` that no other client moves,
//! the server's own CPU time, and settings (`CONFIG SET`) the layout study changes.
//! Persistence is off, as on the shared test Redis (`scripts/services.sh`).

use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use redis::aio::MultiplexedConnection;

pub(crate) struct PrivateRedis {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl PrivateRedis {
    /// Starts `redis-server` (Debian package redis-server) and waits until it answers.
    pub(crate) async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// As [`PrivateRedis::start`], with more server arguments (e.g.
    /// `--enable-debug-command local`).
    pub(crate) async fn start_with(extra: &[&str]) -> Result<Self> {
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|listener| listener.local_addr())
            .context("finding a free port")?
            .port();
        let dir = std::env::temp_dir().join(redisched_testkit::unique("redisched-bench-redis"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let child = redisched_testkit::redis_server(port, &dir)
            .args(["--appendonly", "no"])
            .args(extra)
            .spawn()
            .context("starting redis-server (Debian package redis-server)")?;
        let node = Self { child, port, dir };
        let started = Instant::now();
        loop {
            if let Ok(mut conn) = node.connect().await {
                if redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok()
                {
                    return Ok(node);
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("the private redis-server on port {port} did not answer within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) async fn connect(&self) -> Result<MultiplexedConnection> {
        Ok(redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await?)
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What the server did between two marks: its CPU time (when it is our own child) and
/// the `EVALSHA` time Redis itself counted (`INFO commandstats`: the scripts' run time,
/// without reading requests or writing replies).
#[derive(Clone, Copy)]
pub(crate) struct ServerMark {
    cpu_seconds: Option<f64>,
    evalsha_calls: u64,
    evalsha_usec: u64,
}

impl ServerMark {
    pub(crate) async fn now(conn: &MultiplexedConnection, pid: Option<u32>) -> Result<Self> {
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn.clone())
            .await?;
        let field = |line: &str, name: &str| -> Option<u64> {
            line.split([':', ','])
                .find_map(|part| part.strip_prefix(&format!("{name}=")))
                .and_then(|v| v.trim().parse().ok())
        };
        let evalsha = stats.lines().find(|l| l.starts_with("cmdstat_evalsha:"));
        Ok(Self {
            cpu_seconds: pid.and_then(crate::bridge::common::cpu_seconds),
            evalsha_calls: evalsha.and_then(|l| field(l, "calls")).unwrap_or(0),
            evalsha_usec: evalsha.and_then(|l| field(l, "usec")).unwrap_or(0),
        })
    }

    /// Server CPU µs (if known) and EVALSHA µs since `self`, summed into `into`.
    pub(crate) fn add_since(&self, later: &ServerMark, into: &mut ServerTime) {
        if let (Some(a), Some(b)) = (self.cpu_seconds, later.cpu_seconds) {
            *into.cpu_us.get_or_insert(0.0) += (b - a) * 1e6;
        }
        into.evalsha_calls += later.evalsha_calls.saturating_sub(self.evalsha_calls);
        into.evalsha_usec += later.evalsha_usec.saturating_sub(self.evalsha_usec);
    }
}

/// Summed server time of one side of a comparison.
#[derive(Clone, Copy, Default)]
pub(crate) struct ServerTime {
    pub cpu_us: Option<f64>,
    pub evalsha_calls: u64,
    pub evalsha_usec: u64,
}

impl ServerTime {
    /// µs of script run time per `EVALSHA`, as `INFO commandstats` counts it.
    pub(crate) fn evalsha_us_per_call(&self) -> Option<f64> {
        (self.evalsha_calls > 0).then(|| self.evalsha_usec as f64 / self.evalsha_calls as f64)
    }
}

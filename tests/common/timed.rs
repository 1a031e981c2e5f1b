//! For the tests that judge lateness in milliseconds: such a test runs alone in its
//! binary (`alone`), and every other test of that binary takes `shared`, so they wait for
//! it or it for them. The `bridge` binary holds both kinds in many modules, so each of its
//! tests takes one or the other. Cargo runs one test binary at a time, so that is all the
//! quiet a timed assertion needs from this suite; `alone` also waits (a bounded while) for
//! what an earlier binary left working to settle — the broker deleting its quorum queues, a
//! Redis cleanup — since a run of the whole suite once measured one such test at twice its
//! usual lateness throughout.

use std::time::{Duration, Instant};

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static TIMED: RwLock<()> = RwLock::const_new(());

/// The machine counts as quiet when at least this share of its CPU time was idle over a
/// half-second sample.
const QUIET_IDLE_SHARE: f64 = 0.6;
/// How long `alone` waits for quiet before measuring anyway (and saying so).
const QUIET_WAIT: Duration = Duration::from_secs(30);

/// Held by a timed test for its whole run; taken once the machine is quiet (or after
/// [`QUIET_WAIT`], with a line saying it was not).
pub async fn alone() -> RwLockWriteGuard<'static, ()> {
    let guard = TIMED.write().await;
    wait_for_quiet().await;
    guard
}

/// Held by every other test of a file that has a timed one.
pub async fn shared() -> RwLockReadGuard<'static, ()> {
    TIMED.read().await
}

/// `shared`, for a test without a runtime.
pub fn shared_blocking() -> RwLockReadGuard<'static, ()> {
    TIMED.blocking_read()
}

/// Waits until two half-second samples in a row were at least [`QUIET_IDLE_SHARE`] idle,
/// at most [`QUIET_WAIT`]. Prints what it saw, so a failing timed test shows the machine
/// it ran on.
pub async fn wait_for_quiet() {
    let started = Instant::now();
    let mut quiet_in_a_row = 0;
    let mut seen = Vec::new();
    while started.elapsed() < QUIET_WAIT {
        let Some(idle) = idle_share(Duration::from_millis(500)).await else {
            eprintln!("timed: /proc/stat unreadable; not waiting for a quiet machine");
            return;
        };
        seen.push(idle);
        quiet_in_a_row = if idle >= QUIET_IDLE_SHARE {
            quiet_in_a_row + 1
        } else {
            0
        };
        if quiet_in_a_row >= 2 {
            eprintln!(
                "timed: quiet after {:.1} s (idle share per 0.5 s: {seen:.2?})",
                started.elapsed().as_secs_f64()
            );
            return;
        }
    }
    eprintln!("timed: the machine stayed busy for {QUIET_WAIT:?} (idle share per 0.5 s: {seen:.2?}); measuring anyway");
}

/// The share of all CPUs' time that was idle (idle + iowait) over `over`.
async fn idle_share(over: Duration) -> Option<f64> {
    let before = cpu_times()?;
    tokio::time::sleep(over).await;
    let after = cpu_times()?;
    let total = after.0.saturating_sub(before.0);
    let idle = after.1.saturating_sub(before.1);
    (total > 0).then(|| idle as f64 / total as f64)
}

/// (total, idle) jiffies from the first line of /proc/stat.
fn cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    Some((fields.iter().sum(), idle))
}

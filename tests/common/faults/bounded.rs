//! A fault test's runtime, with a time limit that holds whatever hangs.
//!
//! Fault tests cut connections, hold bytes and kill processes; a hang they provoke may
//! land in the test itself: in its body, in a `Drop` while it unwinds from a failed
//! assertion, or in the runtime's shutdown (which waits for every blocking task). With
//! `#[tokio::test]` none of those is bounded, and one such hang once held CI until its
//! own limit, with nothing printed (libtest shows a test's output only when it ends).
//! [`bounded`] runs the body on its own runtime, shuts that runtime down with a timeout,
//! and arms a watchdog thread: past the limit it writes, straight to the process's stderr
//! (past libtest's capture), which test hung, the last step each fault test recorded
//! ([`step`]) and every thread's stack (gdb, when it is installed), then ends the test
//! binary with a failure.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::FutureExt;

/// A fault test's limit: over three times what the whole fault binary takes on a
/// 2-core machine (~170 s), so only a hang reaches it.
pub const FAULT_TEST_LIMIT: Duration = Duration::from_secs(600);

/// How long a test's runtime may take to shut down once its body ended.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(10);

/// The last step each fault test recorded, by its label: what the watchdog prints.
static STEPS: Mutex<BTreeMap<String, (Instant, String)>> = Mutex::new(BTreeMap::new());

/// Records (and prints, for `--nocapture`) the step the test `label` is starting.
pub fn step(label: &str, what: &str) {
    println!("[{label}] {what}");
    let mut steps = STEPS.lock().unwrap_or_else(|e| e.into_inner());
    steps.insert(label.to_owned(), (Instant::now(), what.to_owned()));
}

/// Runs `body` on a two-worker runtime of its own, failing the whole test binary (with
/// where everything was) if the test, its unwinding or its runtime's shutdown takes
/// longer than `limit`. A panic in `body` fails the test as usual.
pub fn bounded(limit: Duration, body: impl Future<Output = ()>) {
    let test = std::thread::current()
        .name()
        .unwrap_or("a fault test")
        .to_owned();
    let (done, watch) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || match watch.recv_timeout(limit) {
        Ok(()) | Err(RecvTimeoutError::Disconnected) => {}
        Err(RecvTimeoutError::Timeout) => hung(&test, limit),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the test");
    let outcome = runtime.block_on(AssertUnwindSafe(body).catch_unwind());
    runtime.shutdown_timeout(SHUTDOWN_LIMIT);
    let _ = done.send(());
    let _ = watchdog.join();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// The watchdog's verdict: report and end the process.
fn hung(test: &str, limit: Duration) -> ! {
    let mut report = format!(
        "\n==== {test} HUNG: still running after {limit:?} (its body, its unwinding or its \
         runtime's shutdown); ending the test binary\n"
    );
    let steps = STEPS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (label, (at, what)) in &steps {
        report.push_str(&format!(
            "  [{label}] last step, {:?} ago: {what}\n",
            at.elapsed()
        ));
    }
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(report.as_bytes());
    let pid = std::process::id().to_string();
    match std::process::Command::new("gdb")
        .args(["-p", &pid, "-batch", "-ex", "thread apply all bt 40"])
        .output()
    {
        Ok(out) => {
            let _ = stderr.write_all(b"==== every thread's stack (gdb):\n");
            let _ = stderr.write_all(&out.stdout);
        }
        Err(e) => {
            let _ = writeln!(stderr, "==== no stacks: gdb did not run ({e})");
        }
    }
    let _ = stderr.flush();
    std::process::exit(101);
}

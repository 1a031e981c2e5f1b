//! For the tests that judge lateness in milliseconds: such a test runs alone in its
//! binary (`alone`), and the other tests of that file take `shared`, so they wait for it
//! or it for them. Cargo runs one test binary at a time, so this is all the quiet a
//! timed assertion needs from the suite.

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static TIMED: RwLock<()> = RwLock::const_new(());

/// Held by a timed test for its whole run.
pub async fn alone() -> RwLockWriteGuard<'static, ()> {
    TIMED.write().await
}

/// Held by every other test of a file that has a timed one.
pub async fn shared() -> RwLockReadGuard<'static, ()> {
    TIMED.read().await
}

/// `shared`, for a test without a runtime.
pub fn shared_blocking() -> RwLockReadGuard<'static, ()> {
    TIMED.blocking_read()
}

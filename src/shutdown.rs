//! Every bound on how long a shutdown waits, in one place. A deployment's termination
//! grace period (Kubernetes `terminationGracePeriodSeconds`, `docker stop -t`) must
//! cover `dispatch.shutdown_grace_ms` (in-flight confirms, configurable) plus these.
//! And how a background loop yields to the shutdown, so that it stops within its bound:
//! [`next_tick`] and [`unless_shutdown`].

use std::time::Duration;

/// Open HTTP requests get this long to finish (`http::serve`).
pub const HTTP_DRAIN: Duration = Duration::from_secs(5);

/// Each closing step with the broker (channel, connection) waits this long at most
/// (`amqp::close_quietly`).
pub const AMQP_CLOSE: Duration = Duration::from_secs(2);

/// The Redis-side tasks (requeue sweep, notifications, HTTP) get this long to stop
/// once the stages have (`app::run`).
pub const BACKGROUND_TASKS: Duration = Duration::from_secs(5);

/// Waits for the next tick of a background loop: `false` once `shutdown` is cancelled,
/// which wins over a due tick (after work that waited out a timeout the next tick is
/// already due, and a fair pick could keep a loop working past the shutdown).
pub async fn next_tick(
    ticker: &mut tokio::time::Interval,
    shutdown: &tokio_util::sync::CancellationToken,
) -> bool {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => false,
        _ = ticker.tick() => true,
    }
}

/// `work`'s output, or `None` if `shutdown` comes first: a background call stuck on an
/// unreachable Redis must not hold the shutdown up (each script is atomic, so an
/// abandoned call ran whole or not at all).
pub async fn unless_shutdown<T>(
    shutdown: &tokio_util::sync::CancellationToken,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => None,
        done = work => Some(done),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_util::sync::CancellationToken;

    #[tokio::test]
    async fn the_shutdown_wins_over_a_due_tick_every_time() {
        let shutdown = CancellationToken::new();
        // Every tick is due by the time it is asked for.
        let mut ticker = tokio::time::interval(Duration::from_nanos(1));
        assert!(next_tick(&mut ticker, &shutdown).await);
        shutdown.cancel();
        // A fair pick would lose about half of these.
        for _ in 0..200 {
            tokio::time::sleep(Duration::from_micros(5)).await;
            assert!(!next_tick(&mut ticker, &shutdown).await);
        }
    }

    #[tokio::test]
    async fn work_in_flight_is_abandoned_at_the_shutdown_and_finished_work_is_kept() {
        let shutdown = CancellationToken::new();
        assert_eq!(unless_shutdown(&shutdown, async { 7 }).await, Some(7));
        let cancel = shutdown.clone();
        tokio::spawn(async move { cancel.cancel() });
        let stuck = std::future::pending::<()>();
        assert_eq!(unless_shutdown(&shutdown, stuck).await, None);
    }
}

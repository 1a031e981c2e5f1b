//! Stage 3: the safety net. Reservations whose time-to-run passed belong to a bridge
//! that died (or stalled) between reserve and release; this loop, which every bridge
//! runs, makes them due again so another dispatcher delivers them. At-least-once.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::store::{Store, StoreError, MAX_BATCH};

/// Requeues expired reservations of every known topic every `interval`, until shutdown.
pub async fn run(store: Store, metrics: Arc<Metrics>, interval: Duration, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        match sweep(&store).await {
            Ok(0) => {}
            Ok(count) => {
                metrics.jobs_requeued.inc_by(count);
                tracing::warn!(count, "requeued reservations whose time-to-run expired");
            }
            Err(err) => tracing::warn!(error = %err, "requeue sweep failed; next tick retries"),
        }
    }
}

/// One pass over all topics; returns how many reservations were requeued.
pub async fn sweep(store: &Store) -> Result<u64, StoreError> {
    let mut total = 0;
    for topic in store.topics().await? {
        loop {
            let requeued = store.requeue(&topic, MAX_BATCH).await?;
            total += requeued.count;
            if requeued.count < MAX_BATCH as u64 {
                break;
            }
        }
    }
    Ok(total)
}

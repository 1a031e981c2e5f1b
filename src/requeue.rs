//! Stage 3: the safety net. Reservations whose time-to-run passed belong to a bridge
//! that died (or stalled) between reserve and release; this loop, which every bridge
//! runs, makes them due again so another dispatcher delivers them. At-least-once.
//!
//! Each tick handles the next [`CHUNK`] known topics (an SSCAN walk) in one pipelined
//! round trip, so the cost per tick does not grow with the number of topics; with T
//! topics an expired reservation is found within its TTR + T / CHUNK ticks.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::store::{Store, StoreError, MAX_BATCH};

/// Topics requeued per tick.
pub const CHUNK: usize = 1000;

/// Requeues expired reservations, one chunk of topics every `interval`, until shutdown.
pub async fn run(
    store: Store,
    metrics: Arc<Metrics>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut cursor = 0;
    while crate::shutdown::next_tick(&mut ticker, &shutdown).await {
        let Some(swept) =
            crate::shutdown::unless_shutdown(&shutdown, step(&store, &mut cursor)).await
        else {
            return;
        };
        match swept {
            Ok(0) => {}
            Ok(count) => {
                metrics.jobs_requeued.inc_by(count);
                tracing::warn!(count, "requeued reservations whose time-to-run expired");
            }
            Err(err) => tracing::warn!(error = %err, "requeue sweep failed; next tick retries"),
        }
    }
}

/// Requeues the next chunk of topics after `cursor` and advances it (0 = the walk
/// starts over). Returns how many reservations were requeued.
pub async fn step(store: &Store, cursor: &mut u64) -> Result<u64, StoreError> {
    let (next, topics) = store.scan_topics(*cursor, CHUNK).await?;
    let mut total = 0;
    for (topic, requeued) in topics
        .iter()
        .zip(store.requeue_many(&topics, MAX_BATCH).await?)
    {
        total += requeued.count;
        // A full batch means more may be waiting in this topic.
        let mut more = requeued.count == MAX_BATCH as u64;
        while more {
            let requeued = store.requeue(topic, MAX_BATCH).await?;
            total += requeued.count;
            more = requeued.count == MAX_BATCH as u64;
        }
    }
    *cursor = next;
    Ok(total)
}

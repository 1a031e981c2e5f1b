//! Data for the dashboard's pictures that only the store can compute:
//! `GET /v1/topics/{topic}/due-histogram`, the topic's waiting jobs counted by due time.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::error::PathParams;
use super::params::parse_count;
use super::{ApiError, AppState};
use crate::job::Topic;
use crate::store::{DueHistogram, MAX_HISTOGRAM_BUCKETS, MAX_HISTOGRAM_WINDOW_MS};

/// One hour.
const DEFAULT_WINDOW_MS: u64 = 3_600_000;
/// One bucket a minute over the default hour.
const DEFAULT_BUCKETS: usize = 60;

#[derive(Debug, Deserialize)]
pub(super) struct HistogramQuery {
    window_ms: Option<String>,
    buckets: Option<String>,
}

/// One slice of the window: jobs due in `(from, to]` (epoch ms).
#[derive(Debug, Serialize)]
pub(super) struct BucketView {
    pub from: i64,
    pub to: i64,
    pub count: u64,
}

/// The answer of `GET /v1/topics/{topic}/due-histogram`.
#[derive(Debug, Serialize)]
pub(super) struct HistogramView {
    pub topic: Topic,
    /// The Redis server's clock; the window starts here.
    pub now: i64,
    pub window_ms: u64,
    /// Waiting jobs due at or before `now`.
    pub due_now: u64,
    pub buckets: Vec<BucketView>,
    /// Waiting jobs due after the window; parked jobs are counted nowhere.
    pub later: u64,
}

impl HistogramView {
    fn new(topic: Topic, histogram: &DueHistogram) -> Self {
        let buckets = histogram
            .bucket_edges()
            .into_iter()
            .zip(&histogram.counts)
            .map(|((from, to), &count)| BucketView { from, to, count })
            .collect();
        Self {
            topic,
            now: histogram.now,
            window_ms: histogram.window_ms,
            due_now: histogram.due_now,
            buckets,
            later: histogram.later,
        }
    }
}

/// `GET /v1/topics/{topic}/due-histogram?window_ms=&buckets=`.
pub(super) async fn due_histogram(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
    query: Result<Query<HistogramQuery>, QueryRejection>,
) -> Result<Json<HistogramView>, ApiError> {
    let topic = Topic::new(&topic).map_err(|e| ApiError::bad_request(format!("bad topic: {e}")))?;
    let Query(query) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let window_ms = bounded(
        "window_ms",
        query.window_ms.as_deref(),
        DEFAULT_WINDOW_MS,
        MAX_HISTOGRAM_WINDOW_MS,
    )?;
    let buckets = bounded(
        "buckets",
        query.buckets.as_deref(),
        DEFAULT_BUCKETS as u64,
        MAX_HISTOGRAM_BUCKETS as u64,
    )?;
    // `bounded` capped it at MAX_HISTOGRAM_BUCKETS, which fits a usize.
    let buckets = usize::try_from(buckets).unwrap_or(MAX_HISTOGRAM_BUCKETS);
    let histogram = state
        .store
        .due_histogram(&topic, window_ms, buckets)
        .await?;
    Ok(Json(HistogramView::new(topic, &histogram)))
}

/// An integer query value in `1..=max`, `default` when absent. An empty value is
/// refused like any other non-number: the document says integer.
fn bounded(name: &str, raw: Option<&str>, default: u64, max: u64) -> Result<u64, ApiError> {
    let Some(raw) = raw else {
        return Ok(default);
    };
    parse_count(raw)
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| {
            ApiError::bad_request(format!("{name} must be an integer 1..={max}, got {raw:?}"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_bounded_integers() {
        assert_eq!(bounded("buckets", None, 60, 1000).ok(), Some(60));
        assert_eq!(bounded("buckets", Some("24"), 60, 1000).ok(), Some(24));
        assert_eq!(bounded("buckets", Some("1000"), 60, 1000).ok(), Some(1000));
        for bad in [
            "",
            "0",
            "1001",
            "-1",
            "1.5",
            "ten",
            " 5",
            "99999999999999999999999",
        ] {
            let err = bounded("buckets", Some(bad), 60, 1000).unwrap_err();
            assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(
                err.message
                    .starts_with("buckets must be an integer 1..=1000"),
                "{}",
                err.message
            );
        }
    }
}

//! For orchestrators and watchers: health, readiness, metrics, the live event stream.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::{Stream, StreamExt};
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;

use super::{AppState, Shutdown};
use crate::metrics::{Format, TopicSnapshot};

/// How long readiness waits for Redis to answer `PING`.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// The process is alive (nothing else is checked).
pub(super) async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready when Redis answers and the AMQP topology is declared; 503 says which is not.
pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    let redis = match tokio::time::timeout(PING_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no PING reply within {PING_TIMEOUT:?}")),
    };
    let amqp = state.metrics.topology_ready();
    let mut problems = Vec::new();
    if let Err(err) = &redis {
        problems.push(format!("redis: {err}"));
    }
    if !amqp {
        problems.push("amqp: not connected or topology not declared".to_string());
    }
    let body = json!({
        "ready": problems.is_empty(),
        "redis": match &redis { Ok(()) => "ok".to_string(), Err(err) => err.clone() },
        "amqp": if amqp { "ok" } else { "not ready" },
    });
    if problems.is_empty() {
        (StatusCode::OK, Json(body)).into_response()
    } else {
        let mut body = body;
        body["error"] = json!(format!("not ready: {}", problems.join("; ")));
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    }
}

/// The bridge's metrics plus per-topic gauges of what each topic holds now (read from
/// Redis at scrape time), in the classic Prometheus text format or in OpenMetrics as
/// `Accept` asks ([`Format::from_accept`]). If Redis does not answer, the per-topic
/// series are left out (`redisched_redis_up` tells why) rather than failing the scrape.
pub(super) async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let format = Format::from_accept(
        headers
            .get(header::ACCEPT)
            .and_then(|value| value.to_str().ok()),
    );
    match topic_stats(&state).await {
        Ok(rows) => state.metrics.set_topics(
            rows.iter()
                .map(|(topic, stats)| (topic.to_string(), topic_snapshot(stats))),
        ),
        Err(err) => {
            tracing::warn!(error = %err, "metrics: per-topic gauges left out");
            state.metrics.set_topics([]);
        }
    }
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(format.content_type()),
            ),
            // The body depends on Accept: caches must not hand one format to the other.
            (header::VARY, HeaderValue::from_static("accept")),
        ],
        state.metrics.encode_as(format),
    )
        .into_response()
}

/// The per-topic gauges of one topic, as `stats` counts them.
fn topic_snapshot(stats: &crate::store::TopicStats) -> TopicSnapshot {
    TopicSnapshot {
        scheduled: stats.scheduled,
        due: stats.due_now,
        reserved: stats.reserved,
        paused: stats.paused,
        parked: stats.parked,
        failing: stats.failing,
        throttled: stats.throttled,
    }
}

pub(super) async fn topic_stats(
    state: &AppState,
) -> Result<Vec<(crate::job::Topic, crate::store::TopicStats)>, crate::store::StoreError> {
    let topics = state.store.topics().await?;
    let stats =
        futures_util::future::try_join_all(topics.iter().map(|t| state.store.stats(t))).await?;
    Ok(topics.into_iter().zip(stats).collect())
}

/// Server-sent events: each event is the JSON of a [`crate::feed::Event`] (its `kind` is
/// `dispatched` or `command`); a watcher too slow to keep up gets
/// `{"kind":"lagged","missed":N}`. Ends when the server shuts down.
pub(super) async fn events(
    State(state): State<AppState>,
    shutdown: Option<Extension<Shutdown>>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let receiver = state.feed.subscribe();
    let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
        let data = match receiver.recv().await {
            Ok(event) => serde_json::to_string(&event).unwrap_or_default(),
            Err(RecvError::Lagged(missed)) => {
                json!({ "kind": "lagged", "missed": missed }).to_string()
            }
            Err(RecvError::Closed) => return None,
        };
        Some((Ok(SseEvent::default().data(data)), receiver))
    });
    let token = shutdown
        .map(|Extension(Shutdown(token))| token)
        .unwrap_or_default();
    let stream = stream.take_until(token.cancelled_owned());
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

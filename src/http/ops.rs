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

/// Ready when Redis answers and accepts writes (no OOM; no call refused for lack of
/// permission; no eviction policy that may delete jobs unless `redis.allow_eviction`) and
/// the AMQP topology is declared; 503 says which is not. `redis` is "ok", "oom",
/// "refused: NOPERM: …", "evicting" or why Redis does not answer; `redis_health` details
/// what the store knows (see `store::RedisHealth`).
pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    let redis = match tokio::time::timeout(PING_TIMEOUT, state.store.ping()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no PING reply within {PING_TIMEOUT:?}")),
    };
    if redis.is_ok() {
        // Fresh figures when INFO is allowed: an idle bridge writes nothing that could
        // tell that Redis accepts writes again. Best effort: the store keeps the rest.
        tokio::time::timeout(PING_TIMEOUT, state.store.probe_health())
            .await
            .ok();
    }
    let health = state.store.health().view();
    state.metrics.set_redis_health(&health);
    let allow_eviction = state.config.redis.allow_eviction;
    let amqp = state.metrics.topology_ready();
    let mut problems = Vec::new();
    let redis_status = match &redis {
        Err(err) => {
            problems.push(format!("redis: {err}"));
            err.clone()
        }
        Ok(()) if health.oom.is_some() => {
            problems.push(format!(
                "redis: out of memory, Redis refuses writes ({}); ready again when {}",
                health.oom.as_deref().unwrap_or_default(),
                health.oom_until.as_deref().unwrap_or_default()
            ));
            "oom".to_string()
        }
        Ok(()) if health.refused.is_some() => {
            let refused = health.refused.as_deref().unwrap_or_default();
            problems.push(format!(
                "redis: a call is refused for lack of permission, the Redis user's ACL lacks a command it needs ({refused}); ready again when it runs (or none is refused for {} s)",
                crate::store::DENIAL_WINDOW.as_secs()
            ));
            format!("refused: {refused}")
        }
        Ok(()) if health.eviction_policy_ok == Some(false) && !allow_eviction => {
            problems.push(format!(
                "redis: maxmemory-policy {} may evict scheduled jobs (set noeviction, or redis.allow_eviction = true)",
                health.eviction_policy
            ));
            "evicting".to_string()
        }
        Ok(()) => "ok".to_string(),
    };
    if !amqp {
        problems.push("amqp: not connected or topology not declared".to_string());
    }
    let body = json!({
        "ready": problems.is_empty(),
        "redis": redis_status,
        "amqp": if amqp { "ok" } else { "not ready" },
        "redis_health": {
            "writes": if health.oom.is_some() { "refused: out of memory" } else { "ok" },
            "oom": health.oom.is_some(),
            "oom_until": health.oom_until,
            "refused": health.refused,
            "eviction_policy": health.eviction_policy,
            "eviction_policy_ok": health.eviction_policy_ok,
            "eviction_allowed": allow_eviction,
            "evicted_keys": health.evicted_keys,
            "used_memory": health.used_memory,
            "maxmemory": health.maxmemory,
            "unknown_reason": health.unknown_reason,
            "nodes": health.nodes,
        },
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
/// The Redis gauges come from the store's health (one source with `/readyz`), probed
/// afresh.
pub(super) async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let format = Format::from_accept(
        headers
            .get(header::ACCEPT)
            .and_then(|value| value.to_str().ok()),
    );
    let stats = topic_stats(&state).await;
    if stats.is_ok() {
        tokio::time::timeout(PING_TIMEOUT, state.store.probe_health())
            .await
            .ok();
    }
    state.metrics.set_redis_health(&state.store.health().view());
    match stats {
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

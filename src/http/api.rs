//! The REST API over the store (`/v1/topics/…`) and the original project's interface
//! (`POST /schedule/{topic}`, `POST /cancel/{topic}`).

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::Value;

use super::{ApiError, AppState};
use crate::feed::Event;
use crate::job::{Due, DueError, JobId, PutMode, Topic};
use crate::store::{PutOutcome, PutStatus};
use crate::store::{PutRequest, MAX_BATCH};
use crate::view::{DeleteView, JobView, ListView, PutView, TopicsView};

/// Jobs listed when `limit` is not given.
const DEFAULT_LIST_LIMIT: usize = 50;

// ---------------------------------------------------------------------------------
// Reads

/// `GET /v1/topics`: every known topic with its counts.
pub async fn topics(State(state): State<AppState>) -> Result<Json<TopicsView>, ApiError> {
    let rows = super::ops::topic_stats(&state).await?;
    Ok(Json(TopicsView::new(&rows)))
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    limit: Option<String>,
    offset: Option<String>,
    state: Option<String>,
}

/// `GET /v1/topics/{topic}/jobs?limit=&offset=`: the next scheduled jobs, earliest first.
pub async fn list_jobs(
    State(state): State<AppState>,
    Path(topic): Path<String>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<ListView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let Query(query) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let limit = match query.limit.as_deref() {
        None | Some("") => DEFAULT_LIST_LIMIT,
        Some(raw) => raw
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_BATCH).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request(format!("limit must be 1..={MAX_BATCH}, got {raw:?}"))
            })?,
    };
    let offset = match query.offset.as_deref() {
        None | Some("") => 0,
        Some(raw) => raw.parse::<usize>().map_err(|_| {
            ApiError::bad_request(format!(
                "offset must be a non-negative integer, got {raw:?}"
            ))
        })?,
    };
    let which = super::features::list_which(query.state.as_deref())?;
    let jobs = state.store.list_jobs(&topic, which, limit, offset).await?;
    let now = state.store.server_time().await?;
    Ok(Json(ListView::new(&topic, now, &jobs)))
}

/// `GET /v1/topics/{topic}/jobs/{id}`.
pub async fn get_job(
    State(state): State<AppState>,
    Path((topic, id)): Path<(String, String)>,
) -> Result<Json<JobView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let id = parse_id(&id)?;
    match state.store.get(&topic, &id).await? {
        Some(info) => Ok(Json(JobView::new(&topic, id.as_str(), &info))),
        None => Err(not_found(&topic, &id)),
    }
}

// ---------------------------------------------------------------------------------
// Mutations

#[derive(Debug, Deserialize)]
pub struct PutQuery {
    delay_ms: Option<String>,
    at: Option<String>,
    mode: Option<String>,
    replace: Option<String>,
    every: Option<String>,
    cron: Option<String>,
    tz: Option<String>,
}

/// `PUT /v1/topics/{topic}/jobs/{id}?delay_ms=|at=&mode=replace`: the raw body is the job;
/// `every=` or `cron=` (+ `tz=`) make it recurring (`super::features::recurrence`).
pub async fn put_job(
    State(state): State<AppState>,
    Path((topic, id)): Path<(String, String)>,
    query: Result<Query<PutQuery>, QueryRejection>,
    body: Body,
) -> Response {
    let parsed = query
        .map_err(|e| ApiError::bad_request(e.body_text()))
        .and_then(|Query(q)| {
            let due = parse_due(q.delay_ms.as_deref(), q.at.as_deref())?;
            let explicit = [&q.delay_ms, &q.at]
                .iter()
                .any(|v| v.as_deref().is_some_and(|v| !v.is_empty()));
            let recurrence = super::features::recurrence(
                &state,
                q.every.as_deref(),
                q.cron.as_deref(),
                q.tz.as_deref(),
                explicit.then_some(due),
            )?;
            Ok((put_mode(&q)?, due, recurrence))
        });
    let (mode, due, recurrence) = match parsed {
        Ok(parsed) => parsed,
        Err(err) => return finish_put(&state, &topic, &id, PutMode::Keep, Err(err)),
    };
    let result = async {
        let topic = parse_topic(&topic)?;
        let id = parse_id(&id)?;
        let body = read_body(body, state.store.limits().max_body_bytes).await?;
        match recurrence {
            Some(recurrence) => recurrence.put(&state, topic, id, body, mode).await,
            None => put(&state, topic, id, body, due, mode).await,
        }
    }
    .await;
    finish_put(&state, &topic, &id, mode, result)
}

/// `DELETE /v1/topics/{topic}/jobs/{id}`: 404 when there is no such job.
pub async fn delete_job(
    State(state): State<AppState>,
    Path((topic, id)): Path<(String, String)>,
) -> Response {
    let result = delete(&state, &topic, &id).await;
    finish_delete(&state, &topic, &id, result)
}

/// The original project's schedule request. `delay` is in seconds (fractions allowed);
/// `contents` is stored as UTF-8 text (a JSON value other than a string is stored as
/// its JSON text).
#[derive(Debug, Deserialize)]
pub struct CompatSchedule {
    id: Value,
    #[serde(default)]
    contents: Value,
    #[serde(default)]
    delay: Value,
    #[serde(default)]
    replace: bool,
}

#[derive(Debug, Deserialize)]
pub struct CompatCancel {
    id: Value,
}

/// `POST /schedule/{topic}` with `{"id", "contents", "delay"}`.
pub async fn compat_schedule(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(topic): Path<String>,
    body: Body,
) -> Response {
    // JSON escaping can make a body of max_body_bytes up to six times longer.
    let limit = state
        .store
        .limits()
        .max_body_bytes
        .saturating_mul(6)
        .saturating_add(64 * 1024);
    let request = match read_json::<CompatSchedule>(body, limit, &headers).await {
        Ok(request) => request,
        Err(err) => return finish_put(&state, &topic, "", PutMode::Keep, Err(err)),
    };
    let id = id_text(&request.id);
    let mode = if request.replace {
        PutMode::Replace
    } else {
        PutMode::Keep
    };
    let result = async {
        let topic = parse_topic(&topic)?;
        let id = parse_id(&id)?;
        let due = compat_delay(&request.delay)?;
        let body = match request.contents {
            Value::Null => Vec::new(),
            Value::String(text) => text.into_bytes(),
            other => other.to_string().into_bytes(),
        };
        put(&state, topic, id, body, due, mode).await
    }
    .await;
    finish_put(&state, &topic, &id, mode, result)
}

/// `POST /cancel/{topic}` with `{"id"}`: 404 when there is no such job.
pub async fn compat_cancel(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(topic): Path<String>,
    body: Body,
) -> Response {
    let id = match read_json::<CompatCancel>(body, 64 * 1024, &headers).await {
        Ok(request) => id_text(&request.id),
        Err(err) => return finish_delete(&state, &topic, "", Err(err)),
    };
    let result = delete(&state, &topic, &id).await;
    finish_delete(&state, &topic, &id, result)
}

async fn put(
    state: &AppState,
    topic: Topic,
    id: JobId,
    body: Vec<u8>,
    due: Due,
    mode: PutMode,
) -> Result<(PutOutcome, usize), ApiError> {
    let body_bytes = body.len();
    let request = PutRequest {
        topic,
        id,
        body,
        meta: Vec::new(),
        due,
        mode,
    };
    Ok((state.store.put(request).await?, body_bytes))
}

async fn delete(state: &AppState, topic: &str, id: &str) -> Result<(), ApiError> {
    let topic = parse_topic(topic)?;
    let id = parse_id(id)?;
    if state.store.delete(&topic, &id).await? {
        Ok(())
    } else {
        Err(not_found(&topic, &id))
    }
}

/// Counts the command, tells the feed, and answers: 201 for a new job, 200 otherwise.
fn finish_put(
    state: &AppState,
    topic: &str,
    id: &str,
    mode: PutMode,
    result: Result<(PutOutcome, usize), ApiError>,
) -> Response {
    let op = match mode {
        PutMode::Keep => "put",
        PutMode::Replace => "replace",
    };
    match result {
        Ok((outcome, body_bytes)) => {
            record(state, topic, id, op, outcome.status.as_str());
            let status = match outcome.status {
                PutStatus::Scheduled => StatusCode::CREATED,
                PutStatus::Replaced | PutStatus::Duplicate => StatusCode::OK,
            };
            let body = PutView::new(topic, id, &outcome, body_bytes);
            (status, Json(body)).into_response()
        }
        Err(err) => {
            record(state, topic, id, op, err.outcome());
            err.into_response()
        }
    }
}

fn finish_delete(
    state: &AppState,
    topic: &str,
    id: &str,
    result: Result<(), ApiError>,
) -> Response {
    match result {
        Ok(()) => {
            record(state, topic, id, "delete", "deleted");
            Json(DeleteView::deleted(topic, id)).into_response()
        }
        Err(err) => {
            let outcome = if err.status == StatusCode::NOT_FOUND {
                "not_found"
            } else {
                err.outcome()
            };
            record(state, topic, id, "delete", outcome);
            err.into_response()
        }
    }
}

fn record(state: &AppState, topic: &str, id: &str, op: &str, outcome: &str) {
    state.metrics.command(op, outcome);
    state.feed.send(Event::Command {
        topic: topic.to_string(),
        id: id.to_string(),
        op: op.to_string(),
        outcome: outcome.to_string(),
    });
    tracing::info!(topic, id, op, outcome, source = "http", "command");
}

// ---------------------------------------------------------------------------------
// Parsing

pub(super) fn parse_topic(raw: &str) -> Result<Topic, ApiError> {
    Topic::new(raw).map_err(|e| ApiError::bad_request(format!("bad topic: {e}")))
}

pub(super) fn parse_id(raw: &str) -> Result<JobId, ApiError> {
    JobId::new(raw).map_err(|e| ApiError::bad_request(format!("bad job id: {e}")))
}

fn not_found(topic: &Topic, id: &JobId) -> ApiError {
    ApiError::not_found(crate::view::no_such_job(topic, id))
}

fn put_mode(query: &PutQuery) -> Result<PutMode, ApiError> {
    let mut mode = match query.mode.as_deref() {
        None | Some("") | Some("put") | Some("keep") => PutMode::Keep,
        Some("replace") => PutMode::Replace,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "mode must be `put` or `replace`, got {other:?}"
            )))
        }
    };
    match query.replace.as_deref() {
        None | Some("") | Some("false") | Some("0") => {}
        Some("true") | Some("1") => mode = PutMode::Replace,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "replace must be true or false, got {other:?}"
            )))
        }
    }
    Ok(mode)
}

/// `delay_ms` (milliseconds from now) or `at` (epoch ms, or RFC 3339); neither = now.
fn parse_due(delay_ms: Option<&str>, at: Option<&str>) -> Result<Due, ApiError> {
    match (
        delay_ms.filter(|s| !s.is_empty()),
        at.filter(|s| !s.is_empty()),
    ) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("give delay_ms or at, not both")),
        (Some(raw), None) => {
            let raw = raw.trim();
            // Digits only, of any length: a 20-digit delay is out of range, not "not a
            // number".
            let ms = raw
                .strip_prefix('-')
                .unwrap_or(raw)
                .bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| raw.parse::<i128>().unwrap_or(i128::MAX))
                .filter(|_| !raw.is_empty() && raw != "-")
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "delay_ms must be an integer number of milliseconds, got {raw:?}"
                    ))
                })?;
            Ok(Due::delay("delay_ms", raw, ms)?)
        }
        (None, Some(raw)) => {
            let raw = raw.trim();
            if let Ok(ms) = raw.parse::<i128>() {
                return Ok(Due::at("at", raw, ms)?);
            }
            match Due::at_rfc3339("at", raw) {
                Err(DueError::NotATime { detail, .. }) => Err(ApiError::bad_request(format!(
                    "at must be epoch milliseconds or RFC 3339 (2030-01-01T09:00:00Z), got {raw:?}: {detail}"
                ))),
                due => Ok(due?),
            }
        }
        (None, None) => Ok(Due::NOW),
    }
}

/// The compatibility layer's `delay`: seconds, fractions allowed, a number or a
/// numeric string; absent or null = now.
fn compat_delay(delay: &Value) -> Result<Due, ApiError> {
    let seconds = match delay {
        Value::Null => return Ok(Due::NOW),
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    }
    .filter(|s| s.is_finite())
    .ok_or_else(|| {
        ApiError::bad_request(format!("delay must be a number of seconds, got {delay}"))
    })?;
    // `as` saturates; Due::delay refuses what saturated.
    let ms = (seconds * 1000.0).round() as i128;
    Ok(Due::delay("delay", format!("{delay} s"), ms)?)
}

fn id_text(id: &Value) -> String {
    match id {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => String::new(),
    }
}

/// Reads a body of at most `limit` bytes; 413 past it.
async fn read_body(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut stream = body.into_data_stream();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::bad_request(format!("cannot read the body: {e}")))?;
        if bytes.len() + chunk.len() > limit {
            return Err(ApiError::too_large(limit));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

async fn read_json<T: serde::de::DeserializeOwned>(
    body: Body,
    limit: usize,
    headers: &HeaderMap,
) -> Result<T, ApiError> {
    if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
        let json = content_type
            .to_str()
            .map(|ct| {
                ct.trim_start()
                    .to_ascii_lowercase()
                    .starts_with("application/json")
            })
            .unwrap_or(false);
        if !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "expected Content-Type: application/json",
            ));
        }
    }
    let bytes = read_body(body, limit).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_request(format!("bad JSON body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn due_times_parse_from_query_values() {
        assert_eq!(parse_due(Some("1500"), None).ok(), Some(Due::Delay(1500)));
        assert_eq!(parse_due(None, Some("1000")).ok(), Some(Due::At(1000)));
        assert_eq!(
            parse_due(None, Some("1970-01-01T00:00:02Z")).ok(),
            Some(Due::At(2000))
        );
        assert_eq!(parse_due(None, None).ok(), Some(Due::NOW));
        assert!(parse_due(Some("1"), Some("2")).is_err());
        assert!(parse_due(Some("soon"), None).is_err());
        assert!(parse_due(None, Some("tomorrow")).is_err());
        // Out of range and before 1970: refused here, in the user's terms, not by Lua.
        let err = parse_due(Some("12345678901234567"), None).unwrap_err();
        assert!(
            err.message
                .contains("delay_ms 12345678901234567 is out of range"),
            "{}",
            err.message
        );
        let err = parse_due(Some("123456789012345678901234567890"), None).unwrap_err();
        assert!(err.message.contains("out of range"), "{}", err.message);
        let err = parse_due(None, Some("-1")).unwrap_err();
        assert!(
            err.message.contains("at -1 is before 1970"),
            "{}",
            err.message
        );
        let err = parse_due(None, Some("1969-07-20T20:17:00Z")).unwrap_err();
        assert!(err.message.contains("before 1970"), "{}", err.message);
    }

    #[test]
    fn compat_delays_are_seconds() {
        assert_eq!(compat_delay(&json!(1.5)).ok(), Some(Due::Delay(1500)));
        assert_eq!(compat_delay(&json!("2")).ok(), Some(Due::Delay(2000)));
        assert_eq!(compat_delay(&Value::Null).ok(), Some(Due::NOW));
        assert!(compat_delay(&json!("x")).is_err());
        assert!(compat_delay(&json!([1])).is_err());
    }
}

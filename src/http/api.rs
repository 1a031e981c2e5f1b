//! The REST API over the store (`/v1/topics/…`) and the OpenAPI document that describes
//! it. Every query value is parsed exactly as `openapi.json` states it (an empty value
//! is refused like any other value outside the schema, and so is a parameter the
//! document does not list), so that the document and the server agree;
//! `tests/faces/openapi.rs` checks them against each other.

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::Value;
use tracing::Instrument as _;

use super::error::PathParams;
use super::params::{list_which, parse_count, parse_id, parse_topic};
use super::{ApiError, AppState};
use crate::feed::Event;
use crate::job::trace::TraceContext;
use crate::job::{Due, DueError, JobId, PutMode, Topic};
use crate::store::{PutOutcome, PutStatus};
use crate::store::{PutRequest, MAX_BATCH};
use crate::view::{DeleteView, JobView, ListView, PutView, TopicsView};

/// Jobs listed when `limit` is not given.
const DEFAULT_LIST_LIMIT: usize = 50;
/// Largest `offset` of a listing (`lua/list.lua` refuses more; so does the document).
const MAX_LIST_OFFSET: u64 = 1_000_000_000_000;
/// Longest epoch-ms `at`: 16 digits, [`crate::job::MAX_TIME_MS`]'s width.
const MAX_AT_DIGITS: usize = 16;

// ---------------------------------------------------------------------------------
// Reads

/// `GET /v1/topics`: every known topic with its counts, its webhook target and whether
/// that target's breaker holds it.
pub(super) async fn topics(State(state): State<AppState>) -> Result<Json<TopicsView>, ApiError> {
    let targets = &state.config.targets;
    let (rows, health) = tokio::try_join!(
        super::ops::topic_stats(&state),
        state.store.targets_health(targets)
    )?;
    Ok(Json(
        TopicsView::new(&rows)
            .with_targets(targets)
            .with_held_by(targets, &health),
    ))
}

#[derive(Debug, Deserialize)]
pub(super) struct ListQuery {
    limit: Option<String>,
    offset: Option<String>,
    state: Option<String>,
}

/// `GET /v1/topics/{topic}/jobs?limit=&offset=`: the next scheduled jobs, earliest first.
pub(super) async fn list_jobs(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<ListView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let Query(query) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let limit = match query.limit.as_deref() {
        None => DEFAULT_LIST_LIMIT,
        Some(raw) => parse_count(raw)
            .filter(|n| (1..=MAX_BATCH as u64).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "limit must be an integer 1..={MAX_BATCH}, got {raw:?}"
                ))
            })? as usize,
    };
    let offset = match query.offset.as_deref() {
        None => 0,
        Some(raw) => parse_count(raw)
            .filter(|n| *n <= MAX_LIST_OFFSET)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "offset must be an integer 0..={MAX_LIST_OFFSET}, got {raw:?}"
                ))
            })? as usize,
    };
    let which = list_which(query.state.as_deref())?;
    let jobs = state.store.list_jobs(&topic, which, limit, offset).await?;
    let now = state.store.server_time().await?;
    Ok(Json(ListView::new(&topic, now, &jobs)))
}

/// `GET /v1/topics/{topic}/jobs/{id}`.
pub(super) async fn get_job(
    State(state): State<AppState>,
    PathParams((topic, id)): PathParams<(String, String)>,
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

/// An unknown parameter is refused (400), as the document's `additionalProperties:
/// false` says: a misspelt `delay_ms` would otherwise schedule the job now.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PutQuery {
    delay_ms: Option<String>,
    at: Option<String>,
    mode: Option<String>,
    replace: Option<String>,
    every: Option<String>,
    cron: Option<String>,
    tz: Option<String>,
    /// A series' jitter, ms.
    jitter: Option<String>,
    /// The job's own URL (a webhook target's `allowed_url_prefixes`).
    url: Option<String>,
    /// ms after the due time: not delivered by then, the job is set aside as expired
    /// (0 = never; absent: the topic's `[[policies]]` default).
    expires_after: Option<String>,
}

/// `PUT /v1/topics/{topic}/jobs/{id}?delay_ms=|at=&mode=replace`: the raw body is the job;
/// `every=` or `cron=` (+ `tz=`, `jitter=`) make it recurring
/// (`super::features::recurrence`). `traceparent`/`tracestate` headers are stored with it
/// ([`trace_context`]).
pub(super) async fn put_job(
    State(state): State<AppState>,
    PathParams((topic, id)): PathParams<(String, String)>,
    query: Result<Query<PutQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let trace = trace_context(&headers);
    let span = crate::telemetry::http_command_span(
        trace.as_ref(),
        &crate::telemetry::HttpCommand {
            method: "PUT",
            route: "/v1/topics/{topic}/jobs/{id}",
            topic: &topic,
            id: &id,
        },
    );
    let response = put_job_traced(state, topic, id, query, trace, body)
        .instrument(span.clone())
        .await;
    crate::telemetry::record_http_status(&span, response.status().as_u16());
    response
}

async fn put_job_traced(
    state: AppState,
    topic: String,
    id: String,
    query: Result<Query<PutQuery>, QueryRejection>,
    trace: Option<TraceContext>,
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
                q.jitter.as_deref(),
                explicit.then_some(due),
            )?;
            let expires_after = parse_expires_after(q.expires_after.as_deref())?;
            Ok((put_mode(&q)?, due, recurrence, q.url, expires_after))
        });
    let (mode, due, recurrence, url, expires_after) = match parsed {
        Ok(parsed) => parsed,
        Err(err) => return finish_put(&state, &topic, &id, PutMode::Keep, Err(err)),
    };
    let result = async {
        let topic = parse_topic(&topic)?;
        let id = parse_id(&id)?;
        if let Some(url) = &url {
            url::Url::parse(url)
                .map_err(|e| ApiError::bad_request(format!("url: {url:?} is not a URL ({e})")))?;
            crate::targets::check_job_url_for(&state.config.targets, topic.as_str(), url)
                .map_err(|reason| ApiError::url_not_allowed(format!("url: {reason}")))?;
        }
        let jitter_ms = recurrence.as_ref().map_or(0, |r| r.jitter_ms);
        let meta = crate::job::expiry::meta_with_expiry(
            crate::job::trace::meta_of_put(url.as_deref(), jitter_ms, trace.as_ref()),
            expires_after,
        );
        let body = read_body(body, state.store.limits().max_body_bytes).await?;
        match recurrence {
            Some(recurrence) => recurrence.put(&state, topic, id, body, meta, mode).await,
            None => put(&state, topic, id, body, meta, due, mode).await,
        }
    }
    .await;
    finish_put(&state, &topic, &id, mode, result)
}

/// The W3C trace context of a request (`traceparent`, `tracestate`), stored with the job
/// it puts; an invalid one is ignored, as the recommendation asks (never refused).
pub(super) fn trace_context(headers: &HeaderMap) -> Option<TraceContext> {
    TraceContext::from_http(
        headers
            .get_all(crate::job::headers::TRACEPARENT)
            .iter()
            .map(|v| v.as_bytes()),
        headers
            .get_all(crate::job::headers::TRACESTATE)
            .iter()
            .map(|v| v.as_bytes()),
    )
}

/// `DELETE /v1/topics/{topic}/jobs/{id}`: 404 when there is no such job.
pub(super) async fn delete_job(
    State(state): State<AppState>,
    PathParams((topic, id)): PathParams<(String, String)>,
) -> Response {
    let result = delete(&state, &topic, &id).await;
    finish_delete(&state, &topic, &id, result)
}

pub(super) async fn put(
    state: &AppState,
    topic: Topic,
    id: JobId,
    body: Vec<u8>,
    meta: Vec<u8>,
    due: Due,
    mode: PutMode,
) -> Result<(PutOutcome, usize), ApiError> {
    let body_bytes = body.len();
    let request = PutRequest {
        topic,
        id,
        body,
        meta,
        due,
        mode,
    };
    Ok((state.store.put(request).await?, body_bytes))
}

pub(super) async fn delete(state: &AppState, topic: &str, id: &str) -> Result<(), ApiError> {
    let topic = parse_topic(topic)?;
    let id = parse_id(id)?;
    if state.store.delete(&topic, &id).await? {
        Ok(())
    } else {
        Err(not_found(&topic, &id))
    }
}

/// Counts the command, tells the feed, and answers: 201 for a new job, 200 otherwise.
pub(super) fn finish_put(
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

pub(super) fn finish_delete(
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

fn not_found(topic: &Topic, id: &JobId) -> ApiError {
    ApiError::not_found(crate::view::no_such_job(topic, id))
}

fn put_mode(query: &PutQuery) -> Result<PutMode, ApiError> {
    let mut mode = match query.mode.as_deref() {
        None | Some("put") => PutMode::Keep,
        Some("replace") => PutMode::Replace,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "mode must be `put` or `replace`, got {other:?}"
            )))
        }
    };
    match query.replace.as_deref() {
        None | Some("false") | Some("0") => {}
        Some("true") | Some("1") => mode = PutMode::Replace,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "replace must be true, false, 1 or 0, got {other:?}"
            )))
        }
    }
    Ok(mode)
}

/// `delay_ms` (milliseconds from now: an optional `-` and digits) or `at` (epoch ms as
/// digits, or RFC 3339 `YYYY-MM-DDThh:mm:ss[.fff][Z]`); neither = now.
fn parse_due(delay_ms: Option<&str>, at: Option<&str>) -> Result<Due, ApiError> {
    match (delay_ms, at) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("give delay_ms or at, not both")),
        (Some(raw), None) => {
            let digits = raw.strip_prefix('-').unwrap_or(raw);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(ApiError::bad_request(format!(
                    "delay_ms must be an integer number of milliseconds, got {raw:?}"
                )));
            }
            // Digits of any length: a 20-digit delay is out of range, not "not a number".
            let ms = raw.parse::<i128>().unwrap_or(if raw.starts_with('-') {
                i128::MIN
            } else {
                i128::MAX
            });
            Ok(Due::delay("delay_ms", raw, ms)?)
        }
        (None, Some(raw)) => {
            let unsigned = raw.strip_prefix('-').unwrap_or(raw);
            if !unsigned.is_empty() && unsigned.bytes().all(|b| b.is_ascii_digit()) {
                // The document allows 1 to 16 digits: more is out of range even with
                // leading zeros, and any sign is before 1970.
                let ms = match raw.parse::<i128>() {
                    _ if raw.starts_with('-') => -1,
                    Ok(ms) if raw.len() <= MAX_AT_DIGITS => ms,
                    _ => i128::MAX,
                };
                return Ok(Due::at("at", raw, ms)?);
            }
            let not_a_time = |detail: &str| {
                ApiError::bad_request(format!(
                    "at must be epoch milliseconds (up to {MAX_AT_DIGITS} digits) or RFC 3339 \
                     (2030-01-01T09:00:00Z), got {raw:?}{detail}"
                ))
            };
            if !is_rfc3339_shape(raw) {
                return Err(not_a_time(""));
            }
            match Due::at_rfc3339("at", raw) {
                Err(DueError::NotATime { detail, .. }) => Err(not_a_time(&format!(": {detail}"))),
                due => Ok(due?),
            }
        }
        (None, None) => Ok(Due::NOW),
    }
}

/// `YYYY-MM-DDThh:mm:ss`, optional `.` and 1 to 9 fraction digits, optional `Z`, with
/// months 01-12, days 01-31 (29 and 30 not in February, 31 only in long months), hours
/// 00-23, minutes and seconds 00-59: the shape the document's pattern for `at` states
/// (it also requires a year from 1970 on, which [`Due::at_rfc3339`] tells apart).
fn is_rfc3339_shape(raw: &str) -> bool {
    let raw = raw.strip_suffix('Z').unwrap_or(raw);
    let (main, fraction) = match raw.split_once('.') {
        Some((main, fraction)) => (main, Some(fraction)),
        None => (raw, None),
    };
    let b = main.as_bytes();
    let number = |range: std::ops::Range<usize>| {
        main.get(range)
            .filter(|s| s.bytes().all(|c| c.is_ascii_digit()))
            .and_then(|s| s.parse::<u32>().ok())
    };
    let shape = b.len() == 19
        && b[4] == b'-'
        && b[7] == b'-'
        && b[10] == b'T'
        && b[13] == b':'
        && b[16] == b':';
    let fields = (
        number(0..4),
        number(5..7),
        number(8..10),
        number(11..13),
        number(14..16),
        number(17..19),
    );
    let (Some(_), Some(month), Some(day), Some(hour), Some(minute), Some(second)) = fields else {
        return false;
    };
    let last_day = match month {
        2 => 29,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    shape
        && (1..=12).contains(&month)
        && (1..=last_day).contains(&day)
        && hour < 24
        && minute < 60
        && second < 60
        && fraction
            .is_none_or(|f| (1..=9).contains(&f.len()) && f.bytes().all(|c| c.is_ascii_digit()))
}

/// The OpenAPI document as served: `openapi.json` with what depends on this server's
/// configuration (`limits.max_delay_ms`, `limits.max_body_bytes`) and clock filled in
/// where a schema carries `x-redisched-limit` (a `maximum`, or for `delay` as text a
/// `pattern`) or `x-redisched-example` (an `at` within the limit).
pub(super) fn openapi_document(limits: crate::store::Limits) -> Value {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let mut doc: Value = serde_json::from_str(super::OPENAPI_JSON).unwrap_or_default();
    fill_limits(&mut doc, limits, now_ms);
    doc
}

fn fill_limits(value: &mut Value, limits: crate::store::Limits, now_ms: i64) {
    match value {
        Value::Object(map) => {
            match map.get("x-redisched-limit").and_then(Value::as_str) {
                Some("max_delay_ms") => {
                    map.insert("maximum".into(), serde_json::json!(limits.max_delay_ms));
                }
                // `delay` of the original interface is in seconds.
                Some("max_delay_s") => {
                    let max_s = limits.max_delay_ms as f64 / 1000.0;
                    map.insert("maximum".into(), serde_json::json!(max_s));
                }
                Some("max_delay_s_text") => {
                    map.insert(
                        "pattern".into(),
                        Value::String(seconds_text_pattern(limits.max_delay_ms)),
                    );
                }
                _ => {}
            }
            if map.get("x-redisched-example").and_then(Value::as_str) == Some("at") {
                // Well inside the limit, whatever it is: half of it, at most a day ahead.
                let ahead = (limits.max_delay_ms / 2).clamp(0, 86_400_000);
                let at = crate::view::rfc3339(now_ms.saturating_add(ahead) / 1000 * 1000);
                map.insert("example".into(), Value::String(at));
            }
            map.values_mut()
                .for_each(|v| fill_limits(v, limits, now_ms));
        }
        Value::Array(items) => items
            .iter_mut()
            .for_each(|v| fill_limits(v, limits, now_ms)),
        _ => {}
    }
}

/// Integer part digits of `delay` as text (the server reads no more).
const DELAY_TEXT_DIGITS: usize = 10;

/// A regular expression for `delay` as text (`-`, up to 10 integer and 9 fraction
/// digits) whose value is at most `max_ms` / 1000 seconds: exactly the strings the
/// server takes, so that one beyond the limit is outside the schema rather than a
/// schema-valid request answered 422. No lookahead, for generators that lack it.
fn seconds_text_pattern(max_ms: i64) -> String {
    const FRACTION: &str = r"(\.[0-9]{1,9})?";
    let negative = format!("-[0-9]{{1,{DELAY_TEXT_DIGITS}}}{FRACTION}");
    let max_ms = u64::try_from(max_ms).unwrap_or(0);
    let (whole, rest_ms) = (max_ms / 1000, max_ms % 1000);
    let mut branches = vec![negative];
    if whole.to_string().len() > DELAY_TEXT_DIGITS {
        branches.push(format!("[0-9]{{1,{DELAY_TEXT_DIGITS}}}{FRACTION}"));
    } else {
        // Below the whole seconds of the limit: any fraction.
        if whole > 0 {
            for (digits, branch) in at_most(whole - 1) {
                let zeros = DELAY_TEXT_DIGITS - digits;
                branches.push(format!("0{{0,{zeros}}}({branch}){FRACTION}"));
            }
        }
        // The whole seconds of the limit: a fraction up to its milliseconds.
        let digits = whole.to_string().len();
        let zeros = DELAY_TEXT_DIGITS - digits;
        let fraction = fraction_at_most(&format!("{rest_ms:03}000000"));
        branches.push(format!("0{{0,{zeros}}}{whole}(\\.({fraction}))?"));
    }
    format!("^({})$", branches.join("|"))
}

/// Regular expressions for the integers 0..=`max` without leading zeros, one per digit
/// count: (digits, expression).
fn at_most(max: u64) -> Vec<(usize, String)> {
    let top = max.to_string();
    let len = top.len();
    let mut out = Vec::new();
    // Fewer digits than `max`: all of them.
    for digits in 1..len {
        out.push((
            digits,
            match digits {
                1 => "[0-9]".to_string(),
                d => format!("[1-9][0-9]{{{}}}", d - 1),
            },
        ));
    }
    // As many digits: a prefix of `max`, one digit below it, then anything.
    let bytes = top.as_bytes();
    let mut same = Vec::new();
    for (i, &b) in bytes.iter().enumerate() {
        let digit = b - b'0';
        let low = if i == 0 && len > 1 { 1 } else { 0 };
        if digit > low {
            let tail = len - i - 1;
            let tail = if tail > 0 {
                format!("[0-9]{{{tail}}}")
            } else {
                String::new()
            };
            same.push(format!("{}[{low}-{}]{tail}", &top[..i], digit - 1));
        }
    }
    same.push(top.clone());
    out.push((len, same.join("|")));
    out
}

/// 1 to 9 fraction digits whose value, padded with zeros, is at most `limit` (9 digits).
fn fraction_at_most(limit: &str) -> String {
    let mut alternatives = Vec::new();
    for (i, b) in limit.bytes().enumerate() {
        let digit = b - b'0';
        if digit > 0 {
            let rest = limit.len() - i - 1;
            let tail = if rest > 0 {
                format!("[0-9]{{0,{rest}}}")
            } else {
                String::new()
            };
            alternatives.push(format!("{}[0-{}]{tail}", &limit[..i], digit - 1));
        }
        // A prefix of the limit itself: the padding zeros are no more than its rest.
        alternatives.push(limit[..=i].to_string());
    }
    alternatives.join("|")
}

/// Reads a body of at most `limit` bytes; 413 past it.
pub(super) async fn read_body(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
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

/// `expires_after`: ASCII digits only, as the document's integer schema has it (an empty
/// value or a sign is refused, not read as absent), then the expiry's range.
fn parse_expires_after(raw: Option<&str>) -> Result<Option<u64>, ApiError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let ms = parse_count(raw).ok_or_else(|| {
        ApiError::bad_request(format!(
            "expires_after must be a whole number of milliseconds after the due time (0 = never), got {raw:?}"
        ))
    })?;
    crate::job::expiry::check_ms("expires_after", i128::from(ms))
        .map(Some)
        .map_err(|e| ApiError::bad_request(e.0))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn empty_and_signed_values_are_refused_like_the_schema_says() {
        assert!(parse_due(Some(""), None).is_err());
        assert!(parse_due(None, Some("")).is_err());
        assert!(parse_due(Some(" 5"), None).is_err());
        assert!(parse_due(Some("+5"), None).is_err());
        assert!(parse_due(None, Some("+5")).is_err());
        assert!(parse_due(None, Some("12345678901234567")).is_err());
        assert_eq!(parse_count("007"), Some(7));
        for bad in ["", "-1", "+1", " 1", "1.0", "x"] {
            assert_eq!(parse_count(bad), None, "{bad:?}");
            // Seed 7 sent `expires_after=`: read as absent, the job was created (201).
            let err = parse_expires_after(Some(bad)).expect_err(bad);
            assert!(err.message.contains("expires_after"), "{}", err.message);
        }
        assert_eq!(parse_expires_after(None).ok(), Some(None));
        assert_eq!(parse_expires_after(Some("0")).ok(), Some(Some(0)));
        assert!(
            parse_expires_after(Some("1000000000001")).is_err(),
            "over the maximum"
        );
    }

    #[test]
    fn rfc3339_shapes() {
        for good in [
            "2030-01-01T09:00:00Z",
            "2030-01-01T09:00:00",
            "2030-12-31T23:59:59.123456789Z",
            "2032-02-29T00:00:00Z",
            "1969-07-20T20:17:00Z",
        ] {
            assert!(is_rfc3339_shape(good), "{good}");
        }
        for bad in [
            "2030-01-01 09:00:00Z",
            "2030-02-30T00:00:00Z",
            "2030-04-31T00:00:00Z",
            "2030-13-01T00:00:00Z",
            "2030-01-01T24:00:00Z",
            "2030-01-01T09:00:00.Z",
            "2030-01-01T09:00:00+02:00",
            "2030-1-01T09:00:00Z",
            "tomorrow",
        ] {
            assert!(!is_rfc3339_shape(bad), "{bad}");
        }
    }

    #[test]
    fn the_served_document_states_the_configured_limits() {
        let limits = crate::store::Limits {
            max_delay_ms: 5000,
            max_body_bytes: 10,
        };
        let doc = openapi_document(limits);
        let text = doc.to_string();
        assert!(text.contains("\"maximum\":5000,"), "{text}");
        assert!(text.contains("\"maximum\":5.0,"), "{text}");
    }

    #[test]
    fn the_delay_text_pattern_takes_exactly_the_delays_within_the_limit() {
        for (max_ms, fits, beyond) in [
            (
                31_622_400_000,
                &[
                    "0",
                    "31622400",
                    "0031622400",
                    "31622399.999999999",
                    "31622400.000",
                    "-9999999999.5",
                    "1.5",
                ][..],
                &[
                    "31622400.001",
                    "31622401",
                    "0304532528.03",
                    "99999999",
                    "00316224000",
                    "",
                ][..],
            ),
            (
                1_500,
                &["1.5", "1.499", "1.500000000", "0.9", "01"][..],
                &["1.5001", "1.6", "2", "10"][..],
            ),
            (
                90_000,
                &["90", "89.99", "9", "0000000090"][..],
                &["90.1", "91", "100", "00000000090"][..],
            ),
            (999, &["0.999", "0", "0.5"][..], &["1", "0.9991"][..]),
        ] {
            let pattern = seconds_text_pattern(max_ms);
            let re = regex::Regex::new(&pattern).unwrap();
            for text in fits {
                assert!(re.is_match(text), "{text} within {max_ms} ms: {pattern}");
            }
            for text in beyond {
                assert!(!re.is_match(text), "{text} beyond {max_ms} ms: {pattern}");
            }
        }
    }
}

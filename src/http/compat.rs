//! The original project's interface: `POST /schedule/{topic}` and `POST /cancel/{topic}`
//! with JSON bodies. Same store calls, metrics and events as the REST API (`api.rs`).

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use serde_json::Value;
use tracing::Instrument as _;

use super::api::{delete, finish_delete, finish_put, put, read_body, trace_context};
use super::error::PathParams;
use super::params::{parse_id, parse_topic};
use super::{ApiError, AppState};
use crate::job::{float_millis, Due, PutMode, MAX_TIME_MS};
use crate::store::Limits;

/// Longest `delay` given as a string: `-`, 10 integer digits, `.`, 9 fraction digits.
/// Ten digits of seconds are far beyond any `limits.max_delay_ms`, so a delay string
/// that fits the document's pattern is refused only by that limit (422), never as
/// out of range.
const MAX_DELAY_INT_DIGITS: usize = 10;
const MAX_DELAY_FRACTION_DIGITS: usize = 9;

/// The original project's schedule request. `id` is a string or a number (stored as
/// its JSON text); `delay` is in seconds (fractions allowed), a number or a numeric
/// string; `contents` is stored as UTF-8 text (a JSON value other than a string is
/// stored as its JSON text).
#[derive(Debug, Deserialize)]
pub(super) struct CompatSchedule {
    id: Value,
    #[serde(default)]
    contents: Value,
    #[serde(default)]
    delay: Value,
    #[serde(default)]
    replace: bool,
    /// The original frontend sends its cancel here as `"type": "cancellation"`.
    #[serde(default, rename = "type")]
    kind: Value,
}

#[derive(Debug, Deserialize)]
pub(super) struct CompatCancel {
    id: Value,
}

/// `POST /schedule/{topic}` with `{"id", "contents", "delay", "replace"}`.
pub(super) async fn schedule(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathParams(topic): PathParams<String>,
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
    if request.kind == "cancellation" {
        let id = id_text(&request.id).unwrap_or_default();
        let refused = Err(cancel_sent_here(&topic));
        return finish_put(&state, &topic, &id, PutMode::Keep, refused);
    }
    let id = id_text(&request.id);
    let trace = trace_context(&headers);
    let span = crate::telemetry::http_command_span(
        trace.as_ref(),
        &crate::telemetry::HttpCommand {
            method: "POST",
            route: "/schedule/{topic}",
            topic: &topic,
            id: id.as_deref().unwrap_or_default(),
        },
    );
    let mode = if request.replace {
        PutMode::Replace
    } else {
        PutMode::Keep
    };
    let result = async {
        let topic = parse_topic(&topic)?;
        let id = parse_id(id.as_deref().map_err(Clone::clone)?)?;
        let due = delay(&request.delay, state.store.limits())?;
        let body = match request.contents {
            Value::Null => Vec::new(),
            Value::String(text) => text.into_bytes(),
            other => other.to_string().into_bytes(),
        };
        // The request's trace context (invalid: ignored) is stored with the job.
        let meta = crate::job::trace::meta_of_put(None, 0, trace.as_ref());
        put(&state, topic, id, body, meta, due, mode).await
    }
    .instrument(span.clone())
    .await;
    let id = id.unwrap_or_default();
    let response = finish_put(&state, &topic, &id, mode, result);
    crate::telemetry::record_http_status(&span, response.status().as_u16());
    response
}

/// A schedule body with `"type": "cancellation"` (how the original project's frontend
/// sends its cancel, to `/schedule/undefined`): scheduling it would store an empty job
/// that nobody wants, so it is refused, pointing at the endpoint that cancels.
fn cancel_sent_here(topic: &str) -> ApiError {
    ApiError::bad_request(format!(
        "a body with \"type\": \"cancellation\" is a cancel, not a job: send it as POST /cancel/{{topic}} with {{\"id\": …}} (here POST /cancel/{topic}); nothing was scheduled"
    ))
}

/// `POST /cancel/{topic}` with `{"id"}`: 404 when there is no such job.
pub(super) async fn cancel(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathParams(topic): PathParams<String>,
    body: Body,
) -> Response {
    let id = match read_json::<CompatCancel>(body, 64 * 1024, &headers)
        .await
        .and_then(|request| id_text(&request.id))
    {
        Ok(id) => id,
        Err(err) => return finish_delete(&state, &topic, "", Err(err)),
    };
    let result = delete(&state, &topic, &id).await;
    finish_delete(&state, &topic, &id, result)
}

/// `delay`: seconds, fractions allowed, a number or a numeric string (see
/// [`is_delay_text`]); absent or null = now. A number is held to the bounds the
/// document states for it (`-MAX_TIME_MS / 1000` .. `limits.max_delay_ms / 1000`) in
/// seconds, before any rounding, so that a value just past the bound is refused.
fn delay(delay: &Value, limits: Limits) -> Result<Due, ApiError> {
    let seconds = match delay {
        Value::Null => return Ok(Due::NOW),
        Value::Number(n) => n.as_f64(),
        Value::String(s) if is_delay_text(s) => s.parse::<f64>().ok(),
        _ => None,
    }
    .filter(|s| s.is_finite())
    .ok_or_else(|| {
        ApiError::bad_request(format!(
            "delay must be a number of seconds (or a string like \"1.5\"), got {delay}"
        ))
    })?;
    let given = match delay {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if delay.is_number() {
        let min_s = -((MAX_TIME_MS / 1000) as f64);
        if seconds < min_s {
            return Err(ApiError::bad_request(format!(
                "delay {given} s is out of range: at least {min_s} s"
            )));
        }
        let max_s = limits.max_delay_ms as f64 / 1000.0;
        if seconds > max_s {
            return Err(ApiError::delay_too_long(format!(
                "delay {given} s is more than limits.max_delay_ms ({} ms)",
                limits.max_delay_ms
            )));
        }
    }
    // Rounded up: a job is never due early. Saturated values are refused by Due::delay.
    let ms = float_millis(seconds * 1000.0).unwrap_or(i128::MAX);
    Ok(Due::delay("delay", format!("{given} s"), ms)?)
}

/// The string form of `delay`, exactly as the document's pattern says:
/// `^-?[0-9]{1,10}(\.[0-9]{1,9})?$`.
fn is_delay_text(text: &str) -> bool {
    let unsigned = text.strip_prefix('-').unwrap_or(text);
    let (int, fraction) = match unsigned.split_once('.') {
        Some((int, fraction)) => (int, Some(fraction)),
        None => (unsigned, None),
    };
    let digits =
        |s: &str, max: usize| (1..=max).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit());
    digits(int, MAX_DELAY_INT_DIGITS)
        && fraction.is_none_or(|f| digits(f, MAX_DELAY_FRACTION_DIGITS))
}

/// The job id as text: a string as it is, a number as its JSON text; anything else is
/// refused (the document allows a string or a number).
fn id_text(id: &Value) -> Result<String, ApiError> {
    match id {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(ApiError::bad_request(format!(
            "bad job id: must be a string or a number, got {other}"
        ))),
    }
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

    const LIMITS: Limits = Limits {
        max_delay_ms: 60_000,
        max_body_bytes: 1024,
    };

    #[test]
    fn delays_are_seconds() {
        let delay = |v: &Value| delay(v, LIMITS);
        assert_eq!(delay(&json!(1.5)).ok(), Some(Due::Delay(1500)));
        assert_eq!(delay(&json!(0.0001)).ok(), Some(Due::Delay(1)));
        assert_eq!(delay(&json!("2")).ok(), Some(Due::Delay(2000)));
        assert_eq!(delay(&json!("-0.25")).ok(), Some(Due::NOW));
        assert_eq!(delay(&Value::Null).ok(), Some(Due::NOW));
        assert_eq!(delay(&json!(60)).ok(), Some(Due::Delay(60_000)));
        for bad in [
            json!("x"),
            json!([1]),
            json!(" 2"),
            json!("+2"),
            json!("1e3"),
            json!("inf"),
            json!(""),
            json!("."),
            json!("12345678901"),
        ] {
            assert_eq!(
                delay(&bad).map_err(|e| e.status),
                Err(StatusCode::BAD_REQUEST),
                "{bad} should be refused"
            );
        }
        // Just past the documented maximum: refused before rounding could let it in.
        let err = delay(&json!(60.000_000_000_1)).unwrap_err();
        assert_eq!(
            err.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{}",
            err.message
        );
        assert_eq!(err.code, Some("delay_too_long"));
        let err = delay(&json!(-1e300)).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST, "{}", err.message);
        assert!(err.message.contains("out of range"), "{}", err.message);
    }

    #[test]
    fn ids_are_strings_or_numbers() {
        assert_eq!(id_text(&json!("a")).ok().as_deref(), Some("a"));
        assert_eq!(id_text(&json!(0)).ok().as_deref(), Some("0"));
        assert_eq!(id_text(&json!(1.5)).ok().as_deref(), Some("1.5"));
        assert!(id_text(&json!(null)).is_err());
        assert!(id_text(&json!(true)).is_err());
        assert!(id_text(&json!({})).is_err());
    }
}

//! `GET`, `PUT` and `DELETE /v1/topics/{topic}/rate-limit`: a topic's live rate limit,
//! stored in Redis so every bridge obeys it at once (the configuration's
//! `[[policies]]` apply where none is stored). The JSON is the CLI's `--json`
//! (`crate::view::RateLimitView`).

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use serde_json::Value;

use super::api::read_body;
use super::error::PathParams;
use super::params::parse_topic;
use super::{ApiError, AppState};
use crate::feed::Event;
use crate::policy::RateLimit;
use crate::view::RateLimitView;

/// A rate-limit body is a few bytes; anything longer is a mistake.
const MAX_BODY: usize = 4096;

pub(super) async fn get_rate_limit(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
) -> Result<Json<RateLimitView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let now = state.store.rate_state(&topic).await?;
    Ok(Json(RateLimitView::new(&topic, &now, false)))
}

/// `PUT` with `{"max_per_second": 20, "burst": 5}` (`burst` optional: 100 ms worth).
pub(super) async fn put_rate_limit(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<RateLimitView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let json = headers.get(header::CONTENT_TYPE).is_none_or(|ct| {
        ct.to_str().is_ok_and(|ct| {
            ct.trim_start()
                .to_ascii_lowercase()
                .starts_with("application/json")
        })
    });
    if !json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "expected Content-Type: application/json",
        ));
    }
    let body = read_body(body, MAX_BODY).await?;
    let limit = parse_limit(&body)?;
    state.store.set_rate_limit(&topic, limit).await?;
    announce(&state, &topic, "rate-limit", "set");
    let now = state.store.rate_state(&topic).await?;
    Ok(Json(RateLimitView::new(&topic, &now, true)))
}

/// `DELETE`: back to the policy's limit, if any, else unlimited.
pub(super) async fn delete_rate_limit(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
) -> Result<Json<RateLimitView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let removed = state.store.delete_rate_limit(&topic).await?;
    announce(
        &state,
        &topic,
        "rate-limit",
        if removed { "removed" } else { "unchanged" },
    );
    let now = state.store.rate_state(&topic).await?;
    Ok(Json(RateLimitView::new(&topic, &now, removed)))
}

/// The body, with every mistake named in the user's terms (JSON numbers only: a string,
/// a fraction of a burst, an unknown field are refused, not guessed at).
fn parse_limit(body: &[u8]) -> Result<RateLimit, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "body must be JSON like {{\"max_per_second\": 20, \"burst\": 5}}: {e}"
        ))
    })?;
    let Value::Object(fields) = value else {
        return Err(ApiError::bad_request(
            "body must be a JSON object like {\"max_per_second\": 20, \"burst\": 5}",
        ));
    };
    if let Some(unknown) = fields
        .keys()
        .find(|k| !matches!(k.as_str(), "max_per_second" | "burst"))
    {
        return Err(ApiError::bad_request(format!(
            "unknown field {unknown:?}: a rate limit has max_per_second and burst"
        )));
    }
    let rate = match fields.get("max_per_second") {
        None => {
            return Err(ApiError::bad_request(
                "max_per_second is required (jobs per second, e.g. 20 or 0.5)",
            ))
        }
        Some(Value::Number(n)) => n.as_f64().ok_or_else(|| {
            ApiError::bad_request(format!("max_per_second must be a number, got {n}"))
        })?,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "max_per_second must be a JSON number of jobs per second, got {other}"
            )))
        }
    };
    let burst = match fields.get("burst") {
        None => None,
        // A whole JSON number: `2.0` or `2.5` is not a count of jobs.
        Some(Value::Number(n)) if n.is_u64() => n.as_u64().map(|b| b as f64),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "burst must be a whole number of jobs 1..={}, got {other}",
                crate::policy::MAX_BURST
            )))
        }
    };
    RateLimit::new(rate, burst).map_err(|e| ApiError::bad_request(e.0))
}

/// Tells the live feed and the log; not a job command, so `redisched_commands_total`
/// does not count it.
fn announce(state: &AppState, topic: &crate::job::Topic, op: &str, outcome: &str) {
    state.feed.send(Event::Command {
        topic: topic.to_string(),
        id: String::new(),
        op: op.to_string(),
        outcome: outcome.to_string(),
    });
    tracing::info!(%topic, op, outcome, source = "http", "topic operation");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_parse_or_are_refused_with_a_reason() {
        let ok = parse_limit(br#"{"max_per_second": 20, "burst": 5}"#).unwrap();
        assert_eq!((ok.max_per_second, ok.burst), (20.0, 5));
        let half = parse_limit(br#"{"max_per_second": 0.5}"#).unwrap();
        assert_eq!((half.max_per_second, half.burst), (0.5, 1));
        for (body, needle) in [
            (&br#"{"max_per_second": 0}"#[..], "pause"),
            (br#"{"max_per_second": -3}"#, "> 0"),
            (br#"{"max_per_second": "20"}"#, "JSON number"),
            (br#"{"max_per_second": 1e300}"#, "0.001..="),
            (br#"{"max_per_second": 5, "burst": 0}"#, "burst"),
            (br#"{"max_per_second": 5, "burst": 2.5}"#, "burst"),
            (br#"{"burst": 5}"#, "required"),
            (br#"{"max_per_second": 5, "brust": 1}"#, "unknown field"),
            (br#"[20]"#, "object"),
            (br#"{"max_per_second": null}"#, "JSON number"),
            (br#"{"max_per_second": 5, "burst": null}"#, "burst"),
            (br#"{"max_per_second": 5, "burst": -1}"#, "burst"),
            (b"twenty", "JSON"),
        ] {
            let err = parse_limit(body).expect_err("refused");
            assert!(
                err.message.contains(needle),
                "{}: {}",
                String::from_utf8_lossy(body),
                err.message
            );
        }
    }

    /// The document's bounds and the server's agree at the edges: the bound itself is
    /// accepted, the nearest double beyond it refused, written as schemathesis writes it
    /// (Python's shortest repr, which Rust's `{:?}` matches) and as a longer decimal of
    /// that double. Seed 1092975877 sent `1000000.0000000001`: the JSON parser rounded it
    /// down to 1000000 unless it parses floats exactly (serde_json's `float_roundtrip`).
    #[test]
    fn max_per_second_is_refused_exactly_beyond_the_documents_bounds() {
        let doc: Value = serde_json::from_str(include_str!("openapi.json")).expect("document");
        let schema = &doc["components"]["schemas"]["RateLimitRequest"]["properties"];
        let rate = &schema["max_per_second"];
        let (min, max) = (rate["minimum"].as_f64(), rate["maximum"].as_f64());
        let (Some(min), Some(max)) = (min, max) else {
            panic!("the document bounds max_per_second: {rate}");
        };
        let body = |text: &str| format!(r#"{{"max_per_second": {text}}}"#);
        for inside in [min, max] {
            let limit = parse_limit(body(&format!("{inside:?}")).as_bytes());
            assert!(limit.is_ok(), "{inside:?} is within the document's bounds");
        }
        let beyond = [
            "1000000.0000000001".to_string(),
            format!("{:?}", max.next_up()),
            "0.0009999999999999999".to_string(),
            format!("{:?}", min.next_down()),
        ];
        for text in beyond {
            let err = parse_limit(body(&text).as_bytes()).expect_err(&text);
            assert!(
                err.message.contains(&format!(
                    "{}..={}",
                    crate::policy::MIN_RATE,
                    crate::policy::MAX_RATE
                )),
                "{text}: {}",
                err.message
            );
        }
        assert_eq!(
            (min, max),
            (crate::policy::MIN_RATE, crate::policy::MAX_RATE)
        );
    }
}

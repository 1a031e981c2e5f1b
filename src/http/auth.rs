//! Who may call what: one policy table for every route, applied as a middleware so no
//! handler can forget it.
//!
//! | access  | endpoints                                             | token accepted           |
//! |---------|-------------------------------------------------------|--------------------------|
//! | open    | `/healthz`, `/readyz`, `/v1/openapi.json`, `/` (the dashboard page, which holds no data) | none needed |
//! | metrics | `/metrics`                                            | open unless `http.metrics_token` is set; then it, `http.read_token` or `http.token` |
//! | read    | every other `GET` (jobs, lists, topics, the live feed) | `http.read_token` or `http.token` |
//! | write   | everything else (put, delete, rate limits, pause, resume, redrive of a job, a topic or a target's window, legacy `/schedule`, `/cancel`) | `http.token` only |
//!
//! With no `http.token` configured, read and write are open (the listen address is then
//! loopback, or `http.allow_public_without_token` was set on purpose). Job bodies carry what
//! producers put there, so once a token guards writes it guards reads too.
//!
//! The token comes as `Authorization: Bearer <token>`, or for `GET` as the `access_token`
//! query parameter (RFC 6750 §2.3), which browsers need for `EventSource`.

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState};
use crate::config::HttpConfig;

/// What a route needs; ordered from least to most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Access {
    Open,
    Metrics,
    Read,
    Write,
}

/// What a token presented to this server grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grant {
    Nothing,
    Metrics,
    Read,
    Write,
}

/// The policy table: the access `method` on `path` needs.
pub(super) fn required(method: &Method, path: &str) -> Access {
    let reads = *method == Method::GET || *method == Method::HEAD;
    match path {
        "/healthz" | "/readyz" | "/v1/openapi.json" | "/" if reads => Access::Open,
        "/metrics" if reads => Access::Metrics,
        _ if reads => Access::Read,
        _ => Access::Write,
    }
}

/// The middleware: refuses a request whose token does not grant what its route needs.
pub(super) async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let needed = required(request.method(), request.uri().path());
    match check(&state.config.http, needed, &request) {
        Ok(()) => next.run(request).await,
        Err(err) => err.into_response(),
    }
}

fn check(http: &HttpConfig, needed: Access, request: &Request) -> Result<(), ApiError> {
    let open = match needed {
        Access::Open => true,
        Access::Metrics => http.metrics_token.is_empty(),
        Access::Read | Access::Write => http.token.is_empty(),
    };
    if open {
        return Ok(());
    }
    let Some(presented) = presented_token(request)? else {
        return Err(ApiError::unauthorized(match needed {
            Access::Write => "this endpoint changes jobs: send Authorization: Bearer <http.token>",
            _ => "this endpoint shows job data: send Authorization: Bearer <token> (http.read_token or http.token)",
        }));
    };
    let grant = grant_of(http, presented);
    let allowed = match needed {
        Access::Open => true,
        Access::Metrics => grant != Grant::Nothing,
        Access::Read => matches!(grant, Grant::Read | Grant::Write),
        Access::Write => grant == Grant::Write,
    };
    match (allowed, grant) {
        (true, _) => Ok(()),
        (false, Grant::Nothing) => Err(ApiError::unauthorized("wrong bearer token")),
        (false, _) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            match needed {
                Access::Write => "this token may only read: changing jobs needs http.token",
                _ => "this token may only read metrics",
            },
        )),
    }
}

/// The strongest grant `presented` matches. Every configured token is compared in
/// constant time, so timing tells nothing about which one came close.
fn grant_of(http: &HttpConfig, presented: &[u8]) -> Grant {
    let matches =
        |expected: &str| !expected.is_empty() && constant_time_eq(presented, expected.as_bytes());
    let (write, read, metrics) = (
        matches(&http.token),
        matches(&http.read_token),
        matches(&http.metrics_token),
    );
    if write {
        Grant::Write
    } else if read {
        Grant::Read
    } else if metrics {
        Grant::Metrics
    } else {
        Grant::Nothing
    }
}

/// The bearer token of `request`: the `Authorization` header, else (GET only) the
/// `access_token` query parameter. `Ok(None)` when there is none.
fn presented_token(request: &Request) -> Result<Option<&[u8]>, ApiError> {
    if let Some(value) = request.headers().get(header::AUTHORIZATION) {
        let value = value.as_bytes();
        let token = value
            .strip_prefix(b"Bearer ")
            .or_else(|| value.strip_prefix(b"bearer "))
            .ok_or_else(|| ApiError::unauthorized("expected Authorization: Bearer <token>"))?;
        return Ok(Some(token.trim_ascii()));
    }
    if request.method() != Method::GET {
        return Ok(None);
    }
    let query = request.uri().query().unwrap_or("");
    Ok(query
        .split('&')
        .find_map(|pair| pair.strip_prefix("access_token="))
        .map(str::as_bytes))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_table() {
        assert_eq!(required(&Method::GET, "/healthz"), Access::Open);
        assert_eq!(required(&Method::GET, "/"), Access::Open);
        assert_eq!(required(&Method::GET, "/metrics"), Access::Metrics);
        assert_eq!(required(&Method::GET, "/v1/events"), Access::Read);
        assert_eq!(required(&Method::GET, "/v1/topics/t/jobs/x"), Access::Read);
        assert_eq!(required(&Method::PUT, "/v1/topics/t/jobs/x"), Access::Write);
        assert_eq!(required(&Method::POST, "/healthz"), Access::Write);
        assert_eq!(required(&Method::POST, "/schedule/t"), Access::Write);
        assert_eq!(
            required(&Method::POST, "/v1/targets/billing/redrive"),
            Access::Write
        );
        assert_eq!(required(&Method::GET, "/v1/targets"), Access::Read);
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn grants() {
        let http = HttpConfig {
            token: "w".into(),
            read_token: "r".into(),
            metrics_token: "m".into(),
            ..HttpConfig::default()
        };
        assert_eq!(grant_of(&http, b"w"), Grant::Write);
        assert_eq!(grant_of(&http, b"r"), Grant::Read);
        assert_eq!(grant_of(&http, b"m"), Grant::Metrics);
        assert_eq!(grant_of(&http, b""), Grant::Nothing);
        let unset = HttpConfig::default();
        assert_eq!(
            grant_of(&unset, b""),
            Grant::Nothing,
            "an empty token matches nothing"
        );
    }
}

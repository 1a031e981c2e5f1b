//! The HTTP admin API, off the hot path: health and readiness, Prometheus metrics, a
//! REST API over the store, the original project's `/schedule` and `/cancel`
//! endpoints, live events as server-sent events, and the web dashboard at `/`.
//!
//! Every mutation goes through [`Store`] (the same Lua scripts as the bridge), sends a
//! [`crate::feed::Event::Command`] to the feed and counts `redisched_commands{op,outcome}`.
//! With `http.token` set, every endpoint that changes or shows job data needs a token
//! (`auth.rs` holds the one policy table); `/healthz` and `/readyz` stay open.
//!
//! By role: here the router, the security headers of every response and the accept loop
//! (header-read timeout, connection cap); `api.rs` jobs and topics; `features.rs` pause,
//! resume, re-drive, history and a put's schedule parameters; `rate.rs` rate limits;
//! `cancel.rs` cancel by id prefix; `targets.rs` webhook targets and their re-drive by
//! window; `charts.rs` the due histogram; `compat.rs` the original `/schedule` and
//! `/cancel`; `ops.rs` health, readiness, metrics and the event stream; `auth.rs` who may
//! call what; `error.rs` JSON errors and the path extractor; `params.rs` the path and query
//! values every handler parses (so handler modules never import one another);
//! `openapi.json` the contract (served with the configured limits); `dashboard.html` the
//! page.

mod api;
mod auth;
mod cancel;
mod charts;
mod compat;
mod error;
mod features;
mod ops;
mod params;
mod rate;
mod targets;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::feed::Feed;
use crate::metrics::Metrics;
use crate::store::Store;

pub use error::ApiError;

/// How long [`serve`] waits for open requests after shutdown was asked for.
pub const SHUTDOWN_GRACE: Duration = crate::shutdown::HTTP_DRAIN;

const DASHBOARD_HTML: &str = include_str!("dashboard.html");
const OPENAPI_JSON: &str = include_str!("openapi.json");

/// What every handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub store: Store,
    pub metrics: Arc<Metrics>,
    pub feed: Feed,
    pub config: Arc<Config>,
}

/// Ends long-lived responses (the event stream) when the server shuts down.
#[derive(Clone)]
struct Shutdown(CancellationToken);

/// All routes, with `state` attached.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/events", get(ops::events))
        .route("/v1/topics", get(api::topics))
        .route("/v1/targets", get(targets::targets))
        .route("/v1/targets/{name}/redrive", post(targets::redrive))
        .route("/v1/targets/{name}/enable", post(targets::enable))
        .route("/v1/targets/{name}/disable", post(targets::disable))
        .route(
            "/v1/topics/{topic}/jobs",
            get(api::list_jobs).delete(cancel::delete_in_topic),
        )
        .route("/v1/jobs", delete(cancel::delete_everywhere))
        .route(
            "/v1/topics/{topic}/due-histogram",
            get(charts::due_histogram),
        )
        .route(
            "/v1/topics/{topic}/jobs/{id}",
            get(api::get_job).put(api::put_job).delete(api::delete_job),
        )
        .route("/v1/topics/{topic}/pause", post(features::pause))
        .route("/v1/topics/{topic}/resume", post(features::resume))
        .route("/v1/topics/{topic}/redrive", post(features::redrive_topic))
        .route(
            "/v1/topics/{topic}/jobs/{id}/redrive",
            post(features::redrive_job),
        )
        .route("/v1/topics/{topic}/history", get(features::history))
        .route(
            "/v1/topics/{topic}/rate-limit",
            get(rate::get_rate_limit)
                .put(rate::put_rate_limit)
                .delete(rate::delete_rate_limit),
        )
        .route("/schedule/{topic}", post(compat::schedule))
        .route("/cancel/{topic}", post(compat::cancel))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::guard,
        ))
        // Outermost, so refusals from the guard and 404s carry the headers too.
        .layer(axum::middleware::map_response(security_headers))
        .with_state(state)
}

/// `sha256-<base64>` of the text between the first `open` tag and the next `close` tag
/// of the dashboard: what a CSP names to allow that one inline block and nothing else.
fn inline_hash(open: &str, close: &str) -> String {
    let body = DASHBOARD_HTML
        .split_once(open)
        .and_then(|(_, rest)| rest.split_once(close))
        .map_or("", |(body, _)| body);
    use base64::Engine as _;
    let digest = Sha256::digest(body.as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

/// One policy for every response. JSON needs none of it, but the same header everywhere
/// means no route can be framed or sniffed by mistake. The dashboard is one page with one
/// inline `<style>` and one inline `<script>`, allowed by hash; its `fetch` and
/// `EventSource` go to this origin only.
static CONTENT_SECURITY_POLICY: LazyLock<HeaderValue> = LazyLock::new(|| {
    let policy = format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src 'self'; \
         base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
        inline_hash("<script>", "</script>"),
        inline_hash("<style>", "</style>"),
    );
    HeaderValue::from_str(&policy)
        .unwrap_or_else(|_| HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"))
});

/// Adds the security headers to `response` (see `docs/src/security.md`).
async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        CONTENT_SECURITY_POLICY.clone(),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
    response
}

/// Serves [`router`] on `listener` until `shutdown` is cancelled, then lets open
/// requests finish for up to [`SHUTDOWN_GRACE`].
///
/// HTTP/1 only, as before. Two limits from `[http]` guard against clients that hold
/// connections: a connection that has not sent a whole request head within
/// `header_read_timeout_ms` (from its opening, or from its previous response on a
/// keep-alive connection) is closed; at most `max_connections` are open at once, and
/// further ones are not accepted until one closes (they wait in the listen backlog). An
/// event stream is one open connection for as long as it runs; once its request head is
/// read the header timeout no longer applies to it.
pub async fn serve(
    state: AppState,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "http admin api listening");
    }
    let header_timeout = Duration::from_millis(state.config.http.header_read_timeout_ms);
    let max_connections = state.config.http.max_connections.max(1);
    let app = router(state).layer(Extension(Shutdown(shutdown.clone())));
    let slots = Arc::new(Semaphore::new(max_connections));
    // Cancelled after `shutdown`, once accepting stopped: every connection finishes its
    // request in flight and closes.
    let drain = CancellationToken::new();
    loop {
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::debug!(%err, "http admin api: accept failed");
                    if !is_connection_error(&err) {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    continue;
                }
            },
        };
        let service = TowerToHyperService::new(app.clone());
        let drain = drain.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(err) = result {
                        tracing::trace!(%err, "http connection ended");
                    }
                    return;
                }
                _ = drain.cancelled() => conn.as_mut().graceful_shutdown(),
            }
            if let Err(err) = conn.await {
                tracing::trace!(%err, "http connection ended");
            }
        });
    }
    drop(listener);
    drain.cancel();
    // Every connection holds a slot until it ends: all slots back = all connections closed.
    let all_closed = slots.acquire_many(u32::try_from(max_connections).unwrap_or(u32::MAX));
    if tokio::time::timeout(SHUTDOWN_GRACE, all_closed)
        .await
        .is_err()
    {
        tracing::warn!("http admin api: open requests cut off after the shutdown grace");
    }
    Ok(())
}

/// Errors of one connection that failed while being accepted, not of the listener.
fn is_connection_error(err: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        err.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

async fn dashboard() -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        DASHBOARD_HTML,
    )
        .into_response()
}

/// `openapi.json` with this server's configured limits filled in.
async fn openapi(axum::extract::State(state): axum::extract::State<AppState>) -> Response {
    axum::Json(api::openapi_document(state.store.limits())).into_response()
}

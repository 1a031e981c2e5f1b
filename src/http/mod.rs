//! The HTTP admin API, off the hot path: health and readiness, Prometheus metrics, a
//! REST API over the store, the original project's `/schedule` and `/cancel`
//! endpoints, live events as server-sent events, and the web dashboard at `/`.
//!
//! Every mutation goes through [`Store`] (the same Lua scripts as the bridge), sends a
//! [`Event::Command`] to the feed and counts `redisched_commands{op,outcome}`.
//! With `http.token` set, every endpoint that changes or shows job data needs a token
//! (`auth.rs` holds the one policy table); `/healthz` and `/readyz` stay open.

mod api;
mod auth;
mod charts;
mod compat;
mod error;
mod features;
mod ops;
mod targets;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
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
        .route("/v1/topics/{topic}/jobs", get(api::list_jobs))
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
        .route("/schedule/{topic}", post(compat::schedule))
        .route("/cancel/{topic}", post(compat::cancel))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::guard,
        ))
        .with_state(state)
}

/// Serves [`router`] on `listener` until `shutdown` is cancelled, then lets open
/// requests finish for up to [`SHUTDOWN_GRACE`].
pub async fn serve(
    state: AppState,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "http admin api listening");
    }
    let app = router(state).layer(Extension(Shutdown(shutdown.clone())));
    let server =
        axum::serve(listener, app).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    tokio::select! {
        result = server => result,
        _ = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            tracing::warn!("http admin api: open requests cut off after the shutdown grace");
            Ok(())
        }
    }
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

//! `GET /v1/targets`: the webhook targets with their topics and this bridge's live
//! state (in flight, last status, failures); `POST /v1/targets/{name}/redrive`: the
//! parked jobs of the target's topics whose last failure falls in a time window;
//! `POST /v1/targets/{name}/enable` and `…/disable`: the target's breaker by hand.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;

use super::error::PathParams;
use super::{ApiError, AppState};
use crate::feed::Event;
use crate::job::window::FailureWindow;
use crate::store::HealthOp;
use crate::view::{
    no_such_target, TargetHealthFields, TargetRedriveView, TargetStateChanged, TargetsView,
};

pub(super) async fn targets(State(state): State<AppState>) -> Result<Json<TargetsView>, ApiError> {
    let webhooks = &state.metrics.webhooks;
    let health = state.store.targets_health(&state.config.targets).await?;
    Ok(Json(
        TargetsView::new(&state.config.targets, |name| Some(webhooks.status(name)))
            .with_health(&health),
    ))
}

/// `POST /v1/targets/{name}/enable`: closed again, counts and trips reset.
pub(super) async fn enable(
    State(state): State<AppState>,
    PathParams(name): PathParams<String>,
) -> Result<Json<TargetStateChanged>, ApiError> {
    by_hand(&state, &name, HealthOp::Enable).await
}

/// `POST /v1/targets/{name}/disable`: nothing is sent until it is enabled.
pub(super) async fn disable(
    State(state): State<AppState>,
    PathParams(name): PathParams<String>,
) -> Result<Json<TargetStateChanged>, ApiError> {
    by_hand(&state, &name, HealthOp::Disable).await
}

/// The change is announced (logged, counted, published) by the first bridge to sync
/// the target's health next (within a second).
async fn by_hand(
    state: &AppState,
    name: &str,
    op: HealthOp,
) -> Result<Json<TargetStateChanged>, ApiError> {
    let targets = &state.config.targets;
    let Some(target) = targets.iter().find(|t| t.name == name) else {
        return Err(ApiError::not_found(no_such_target(name, targets)));
    };
    let what = if op == HealthOp::Enable {
        "enable"
    } else {
        "disable"
    };
    let h = state.store.target_health(name, &target.breaker, op).await?;
    tracing::info!(target = %name, state = %h.state.as_str(), source = "http", "{what} by hand");
    Ok(Json(TargetStateChanged {
        target: name.to_owned(),
        health: TargetHealthFields::new(&h),
    }))
}

#[derive(Debug, Deserialize)]
pub(super) struct WindowQuery {
    since: Option<String>,
    until: Option<String>,
}

/// `POST /v1/targets/{name}/redrive?since=&until=`: every parked job of every known
/// topic the target serves whose last failure lies in `since..=until` (epoch ms or RFC
/// 3339; default: from 1970 to the Redis server's now) is made due now, attempts kept,
/// a bounded script call at a time. 404 for a target the configuration does not name.
pub(super) async fn redrive(
    State(state): State<AppState>,
    PathParams(name): PathParams<String>,
    query: Result<Query<WindowQuery>, QueryRejection>,
) -> Result<Json<TargetRedriveView>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let targets = &state.config.targets;
    if !targets.iter().any(|t| t.name == name) {
        return Err(ApiError::not_found(no_such_target(&name, targets)));
    }
    let now = state.store.server_time().await?;
    let window = FailureWindow::parse(
        ("since", "until"),
        query.since.as_deref(),
        query.until.as_deref(),
        now,
    )
    .map_err(|e| ApiError::bad_request(e.0))?;
    let topics = state.store.topics().await?;
    let served: Vec<_> = crate::targets::served_by(targets, &name, &topics)
        .into_iter()
        .cloned()
        .collect();
    let moved = state.store.redrive_window_topics(&served, window).await?;
    for (topic, n) in &moved {
        if *n > 0 {
            state.feed.send(Event::Command {
                topic: topic.to_string(),
                id: String::new(),
                op: "redrive".into(),
                outcome: "re-driven".into(),
            });
            tracing::info!(%topic, target = %name, redriven = n, since = window.since, until = window.until, source = "http", "re-drive by target");
        }
    }
    Ok(Json(TargetRedriveView::new(&name, window, &moved)))
}

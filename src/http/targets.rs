//! `GET /v1/targets`: the webhook targets with their topics and this bridge's live
//! state (in flight, last status, failures).

use axum::extract::State;
use axum::Json;

use super::AppState;
use crate::view::TargetsView;

pub(super) async fn targets(State(state): State<AppState>) -> Json<TargetsView> {
    let webhooks = &state.metrics.webhooks;
    Json(TargetsView::new(&state.config.targets, |name| {
        Some(webhooks.status(name))
    }))
}

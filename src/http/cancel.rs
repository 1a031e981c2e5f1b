//! Cancel by id prefix over REST: `DELETE /v1/topics/{topic}/jobs?id_prefix=` (one
//! topic) and `DELETE /v1/jobs?id_prefix=` (every known topic). The store walks each
//! topic in bounded steps (`lua/delete_prefix.lua`), so one request on a large topic
//! is many short script calls, never one long one.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;

use super::error::PathParams;
use super::params::parse_topic;
use super::{ApiError, AppState};
use crate::feed::Event;
use crate::job::{IdPrefix, Topic};
use crate::view::PrefixDeleteView;

/// An unknown parameter is refused (400), as the document's `additionalProperties:
/// false` says: a misspelt `id_prefix` must not pass unseen.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PrefixQuery {
    id_prefix: Option<String>,
    force: Option<String>,
}

impl PrefixQuery {
    fn prefix(query: Result<Query<Self>, QueryRejection>) -> Result<IdPrefix, ApiError> {
        let Query(query) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
        let force = match query.force.as_deref() {
            None | Some("false") => false,
            Some("true") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "force must be true or false, got {other:?}"
                )))
            }
        };
        let raw = query.id_prefix.ok_or_else(|| {
            ApiError::bad_request("id_prefix is required (the start of the ids to delete)")
        })?;
        IdPrefix::new(raw, force).map_err(|e| ApiError::bad_request(e.to_string()))
    }
}

/// `DELETE /v1/topics/{topic}/jobs?id_prefix=...[&force=true]`.
pub(super) async fn delete_in_topic(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
    query: Result<Query<PrefixQuery>, QueryRejection>,
) -> Result<Json<PrefixDeleteView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let prefix = PrefixQuery::prefix(query)?;
    let deleted = state.store.delete_prefix(&topic, &prefix, None).await?;
    Ok(answer(&state, &prefix, false, &[(topic, deleted)]))
}

/// `DELETE /v1/jobs?id_prefix=...[&force=true]`: in every known topic.
pub(super) async fn delete_everywhere(
    State(state): State<AppState>,
    query: Result<Query<PrefixQuery>, QueryRejection>,
) -> Result<Json<PrefixDeleteView>, ApiError> {
    let prefix = PrefixQuery::prefix(query)?;
    let deleted = state.store.delete_prefix_everywhere(&prefix).await?;
    Ok(answer(&state, &prefix, true, &deleted))
}

fn answer(
    state: &AppState,
    prefix: &IdPrefix,
    all_topics: bool,
    deleted: &[(Topic, u64)],
) -> Json<PrefixDeleteView> {
    let total: u64 = deleted.iter().map(|(_, n)| n).sum();
    let outcome = if total > 0 { "deleted" } else { "not_found" };
    state.metrics.command("delete-prefix", outcome);
    for (topic, n) in deleted {
        tracing::info!(%topic, id_prefix = %prefix, deleted = n, "jobs cancelled by id prefix");
        state.feed.send(Event::Command {
            topic: topic.to_string(),
            id: format!("{prefix}*"),
            op: "delete-prefix".into(),
            outcome: format!("deleted {n}"),
        });
    }
    Json(PrefixDeleteView::new(prefix, all_topics, deleted))
}

//! The REST faces of the scheduler features: pause and resume a topic,
//! redrive parked jobs, a topic's outcome history, and the schedule parameters of a put.
//! The JSON is the CLI's `--json` (`crate::view`).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;

use super::error::PathParams;
use super::params::{parse_count, parse_id, parse_topic};
use super::{ApiError, AppState};
use crate::feed::Event;
use crate::job::schedule::{PartsError, Schedule, ScheduleParts};
use crate::job::{Due, JobId, PutMode, Topic};
use crate::store::{PutOutcome, PutRequest, MAX_BATCH};
use crate::view::{HistoryView, PauseView, RedriveView};

/// History entries shown when `limit` is not given.
const DEFAULT_HISTORY_LIMIT: usize = 50;

/// `POST /v1/topics/{topic}/pause`: nothing of the topic is dispatched until resumed;
/// commands are still applied. A topic without jobs can be paused.
pub(super) async fn pause(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
) -> Result<Json<PauseView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let changed = state.store.pause(&topic).await?;
    announce(
        &state,
        &topic,
        "",
        "pause",
        if changed { "paused" } else { "unchanged" },
    );
    Ok(Json(PauseView {
        topic,
        paused: true,
        changed,
    }))
}

/// `POST /v1/topics/{topic}/resume`: the topic's due jobs are dispatched again.
pub(super) async fn resume(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
) -> Result<Json<PauseView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let changed = state.store.resume(&topic).await?;
    announce(
        &state,
        &topic,
        "",
        "resume",
        if changed { "resumed" } else { "unchanged" },
    );
    Ok(Json(PauseView {
        topic,
        paused: false,
        changed,
    }))
}

/// `POST /v1/topics/{topic}/jobs/{id}/redrive`: a parked job due now, attempts kept.
/// 404 when there is no such job, 409 when it is not parked.
pub(super) async fn redrive_job(
    State(state): State<AppState>,
    PathParams((topic, id)): PathParams<(String, String)>,
) -> Result<Json<RedriveView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let id = parse_id(&id)?;
    if !state.store.redrive(&topic, &id).await? {
        return Err(not_redriven(&state, &topic, &id).await?);
    }
    announce(&state, &topic, id.as_str(), "redrive", "re-driven");
    Ok(Json(RedriveView {
        topic,
        id: Some(id.to_string()),
        redriven: 1,
    }))
}

/// `POST /v1/topics/{topic}/redrive`: every parked job of the topic due now.
pub(super) async fn redrive_topic(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
) -> Result<Json<RedriveView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let redriven = state.store.redrive_topic(&topic).await?;
    announce(&state, &topic, "", "redrive", "re-driven");
    Ok(Json(RedriveView {
        topic,
        id: None,
        redriven,
    }))
}

#[derive(Debug, Deserialize)]
pub(super) struct HistoryQuery {
    id: Option<String>,
    limit: Option<String>,
}

/// `GET /v1/topics/{topic}/history?id=&limit=`: the latest outcomes, newest first.
pub(super) async fn history(
    State(state): State<AppState>,
    PathParams(topic): PathParams<String>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<Json<HistoryView>, ApiError> {
    let topic = parse_topic(&topic)?;
    let Query(query) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    // An empty value is refused rather than read as "absent", as everywhere in the API.
    let id = match query.id.as_deref() {
        None => None,
        Some(raw) => Some(parse_id(raw)?),
    };
    let limit = match query.limit.as_deref() {
        None => DEFAULT_HISTORY_LIMIT,
        Some(raw) => parse_count(raw)
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| (1..=MAX_BATCH).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request(format!("limit must be 1..={MAX_BATCH}, got {raw:?}"))
            })?,
    };
    let entries = state.store.history(&topic, id.as_ref(), limit).await?;
    Ok(Json(HistoryView::new(&topic, id.as_ref(), &entries)))
}

/// A recurring put: its schedule and the first time it was asked for (`delay_ms`/`at`).
pub(super) struct Recurrence {
    schedule: Schedule,
    explicit: Option<Due>,
    /// `jitter` (ms), checked against the schedule; 0 for none.
    pub(super) jitter_ms: u64,
}

/// The schedule parameters of a put: `every` (ms or `15m`-style), or `cron` with an
/// optional `tz` and `jitter` (ms); `None` for a one-shot put. A value outside the form
/// the document states for it ([`check_forms`]) and a combination it forbids are 400s;
/// a well-formed value the server cannot use (an interval below
/// `limits.min_interval_ms`, a cron field out of range or an expression that never
/// fires, an unknown zone, a jitter not below the interval) is 422 `invalid_schedule`,
/// as no schema can state those rules.
pub(super) fn recurrence(
    state: &AppState,
    every: Option<&str>,
    cron: Option<&str>,
    tz: Option<&str>,
    jitter: Option<&str>,
    explicit: Option<Due>,
) -> Result<Option<Recurrence>, ApiError> {
    for (name, value) in [
        ("every", every),
        ("cron", cron),
        ("tz", tz),
        ("jitter", jitter),
    ] {
        if value == Some("") {
            return Err(ApiError::bad_request(format!(
                "{name} must not be empty (leave it out for a one-shot job)"
            )));
        }
    }
    check_forms(every, cron, tz, jitter)?;
    let parts = ScheduleParts {
        every,
        cron,
        tz,
        jitter,
    };
    let (schedule, jitter_ms) =
        match Schedule::from_parts(parts, state.config.limits.min_interval_ms) {
            Ok(Some(recurring)) => recurring,
            Ok(None) => return Ok(None),
            Err(
                err @ (PartsError::BothEveryAndCron
                | PartsError::TzWithoutCron
                | PartsError::JitterWithoutSchedule),
            ) => return Err(ApiError::bad_request(parts_error(&err))),
            Err(err) => return Err(ApiError::invalid_schedule(parts_error(&err))),
        };
    Ok(Some(Recurrence {
        schedule,
        explicit,
        jitter_ms,
    }))
}

/// The forms `openapi.json` states for the schedule parameters (its patterns; like every
/// pattern there, beside `"not": {"pattern": "\\n"}`, so that no validator lets `$`
/// match before a final newline):
/// - `every`: `^([0-9]+|([0-9]+(ms|s|m|h|d|w))+)$`;
/// - `cron`: `^[0-9A-Za-z*?,/#-]+( +[0-9A-Za-z*?,/#-]+){4,5}$`;
/// - `tz`: `^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$`;
/// - `jitter`: `^[0-9]{1,13}$`.
fn check_forms(
    every: Option<&str>,
    cron: Option<&str>,
    tz: Option<&str>,
    jitter: Option<&str>,
) -> Result<(), ApiError> {
    if let Some(every) = every.filter(|e| !is_every_form(e)) {
        return Err(ApiError::bad_request(format!(
            "every: interval {every:?} is neither milliseconds nor a duration like 15m or 1h30m (digits, or digits each followed by ms, s, m, h, d or w)"
        )));
    }
    if let Some(cron) = cron.filter(|c| !is_cron_form(c)) {
        return Err(ApiError::bad_request(format!(
            "cron: cron expression {cron:?} must be fields of 0-9 A-Z a-z * ? , / # - separated by spaces; expected 5 (minute hour day-of-month month day-of-week) or 6 (a leading seconds field)"
        )));
    }
    if let Some(tz) = tz.filter(|t| !is_zone_form(t)) {
        return Err(ApiError::bad_request(format!(
            "tz: {tz:?} is not an IANA time zone name (letters, digits, _ + - in parts separated by /, such as Europe/Berlin or UTC)"
        )));
    }
    if let Some(jitter) = jitter.filter(|j| !is_jitter_form(j)) {
        return Err(ApiError::bad_request(format!(
            "jitter: jitter {jitter:?} is not a number of milliseconds >= 0 (1 to 13 digits)"
        )));
    }
    Ok(())
}

fn is_digits(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

fn is_every_form(text: &str) -> bool {
    if is_digits(text) {
        return true;
    }
    let mut rest = text.as_bytes();
    if rest.is_empty() {
        return false;
    }
    while !rest.is_empty() {
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        // `ms` before `m`: after either only digits or the end may follow.
        let unit = match rest {
            [b'm', b's', ..] => 2,
            [b's' | b'm' | b'h' | b'd' | b'w', ..] => 1,
            _ => return false,
        };
        rest = &rest[unit..];
    }
    true
}

fn is_cron_form(text: &str) -> bool {
    let field = |f: &str| {
        !f.is_empty()
            && f.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"*?,/#-".contains(&b))
    };
    let fields: Vec<&str> = text.split(' ').filter(|f| !f.is_empty()).collect();
    !text.starts_with(' ')
        && !text.ends_with(' ')
        && (5..=6).contains(&fields.len())
        && fields.into_iter().all(field)
}

fn is_zone_form(text: &str) -> bool {
    text.split('/').all(|part| {
        !part.is_empty()
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_+-".contains(&b))
    })
}

fn is_jitter_form(text: &str) -> bool {
    is_digits(text) && text.len() <= 13
}

/// A refused schedule in the query parameters' names.
fn parts_error(err: &PartsError) -> String {
    match err {
        PartsError::BothEveryAndCron => "give every or cron, not both".to_owned(),
        PartsError::TzWithoutCron => "tz is only meaningful with cron".to_owned(),
        PartsError::JitterWithoutSchedule => "jitter is only for a recurring job (give every or cron): a one-shot job has no occurrences to spread".to_owned(),
        PartsError::Every(e) => format!("every: {e}"),
        PartsError::Cron(e) => format!("cron: {e}"),
        PartsError::Jitter(e) => format!("jitter: {e}"),
    }
}

impl Recurrence {
    /// Stores the recurring job, first due per [`Schedule::first_due`].
    pub(super) async fn put(
        &self,
        state: &AppState,
        topic: Topic,
        id: JobId,
        body: Vec<u8>,
        meta: Vec<u8>,
        mode: PutMode,
    ) -> Result<(PutOutcome, usize), ApiError> {
        let now = state.store.server_time().await?;
        let due = self
            .schedule
            .first_due(self.explicit, now)
            .map_err(ApiError::invalid_schedule)?;
        let spec = self
            .schedule
            .store_spec()
            .map_err(|e| ApiError::invalid_schedule(e.to_string()))?;
        let body_bytes = body.len();
        let request = PutRequest {
            topic,
            id,
            body,
            meta,
            due,
            mode,
        };
        let bound = match due {
            Due::At(first) => self.schedule.jitter_bound(first, self.jitter_ms),
            Due::Delay(_) => self.jitter_ms,
        };
        Ok((
            state.store.put_jittered(request, spec, bound).await?,
            body_bytes,
        ))
    }
}

/// Why a redrive of one job moved nothing: 404 without the job, 409 when it is not parked.
async fn not_redriven(state: &AppState, topic: &Topic, id: &JobId) -> Result<ApiError, ApiError> {
    let info = state.store.get(topic, id).await?;
    Ok(match crate::view::not_parked(topic, id, info.as_ref()) {
        (false, message) => ApiError::not_found(message),
        (true, message) => ApiError::new(StatusCode::CONFLICT, message),
    })
}

/// Tells the live feed and the log; these are not job commands, so
/// `redisched_commands_total` does not count them.
fn announce(state: &AppState, topic: &Topic, id: &str, op: &str, outcome: &str) {
    state.feed.send(Event::Command {
        topic: topic.to_string(),
        id: id.to_string(),
        op: op.to_string(),
        outcome: outcome.to_string(),
    });
    tracing::info!(%topic, id, op, outcome, source = "http", "topic operation");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_forms_follow_the_documented_patterns() {
        for every in ["900000", "0", "15m", "1h30m", "5ms", "2w3d", "1m5s", "007s"] {
            assert!(is_every_form(every), "{every:?}");
        }
        for every in [
            "", " 15m", "15 m", "1.5h", "-5", "15min", "m", "1h30", "15m\n", "1y", "\n",
        ] {
            assert!(!is_every_form(every), "{every:?}");
        }
        for cron in [
            "0 9 * * MON-FRI",
            "*/5  * * * * *",
            "0 0 L * ?",
            "0 9 * * 1#2",
        ] {
            assert!(is_cron_form(cron), "{cron:?}");
        }
        for cron in [
            "0 9 * *",
            " 0 9 * * *",
            "0 9 * * * ",
            "0\t9 * * * *",
            "@daily",
            "0 9 * * * * *",
            "0 9 * * *\n",
        ] {
            assert!(!is_cron_form(cron), "{cron:?}");
        }
        for tz in [
            "UTC",
            "Europe/Berlin",
            "America/Argentina/Buenos_Aires",
            "Etc/GMT+5",
            "Mars/Olympus",
        ] {
            assert!(is_zone_form(tz), "{tz:?}");
        }
        for tz in [
            "",
            "/UTC",
            "Europe//Berlin",
            "Europe/",
            "Europe Berlin",
            "UTC|x",
            "UTC\n",
        ] {
            assert!(!is_zone_form(tz), "{tz:?}");
        }
        assert!(is_jitter_form("9999999999999") && !is_jitter_form("5\n"));
        assert!(
            !is_jitter_form("10000000000000") && !is_jitter_form(" 5") && !is_jitter_form("-1")
        );
    }
}

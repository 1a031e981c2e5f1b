//! What the faces show: the JSON of the HTTP API and of `redisched … --json`, one
//! serializable view per thing, so the two answer the same thing identically. Also
//! the one place that formats times for people (RFC 3339). `target_redrive.rs` holds
//! the answer to a re-drive by target, `held_by.rs` a topic held by its target's breaker.

use std::time::{Duration, UNIX_EPOCH};

use base64::Engine as _;
use serde::Serialize;

use crate::job::spec::{ScheduleSpec, SpecKind};
use crate::job::{IdPrefix, JobId, Topic};
use crate::metrics::TargetStatus;
use crate::policy::RateLimit;
use crate::store::{
    HistoryEntry, JobInfo, JobState, JobSummary, LastError, Outcome, PutOutcome, PutStatus,
    RateSource, RateState, TopicStats,
};
use crate::targets::{target_for, TargetConfig};

mod held_by;
mod target_redrive;
pub use held_by::HeldBy;
pub use target_redrive::{no_such_target, TargetRedriveView, TopicRedriven};

/// First epoch ms that RFC 3339 (years 0000–9999) cannot show.
const YEAR_10000_MS: i64 = 253_402_300_800_000;

/// Epoch ms as RFC 3339 UTC with milliseconds (`1970-01-01T00:00:01.000Z`); the number
/// itself outside 1970–9999, which the formatter cannot show (it would panic).
pub fn rfc3339(ms: i64) -> String {
    if !(0..YEAR_10000_MS).contains(&ms) {
        return ms.to_string();
    }
    let time = UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs());
    humantime::format_rfc3339_millis(time).to_string()
}

/// The "not found" text of both faces, with the id and topic as the user wrote them.
pub fn no_such_job(topic: &Topic, id: &JobId) -> String {
    format!("no job {id} in topic {topic}")
}

/// A view as a JSON value (for the CLI, which prints it).
pub fn to_json(view: &impl Serialize) -> serde_json::Value {
    // Views are plain structs of strings and numbers: serializing them cannot fail.
    serde_json::to_value(view).unwrap_or(serde_json::Value::Null)
}

/// One topic's counts: a row of `GET /v1/topics` and `redisched stats --json`.
#[derive(Debug, Clone, Serialize)]
pub struct StatsRow {
    pub topic: Topic,
    pub scheduled: u64,
    pub due_now: u64,
    pub reserved: u64,
    pub expired: u64,
    pub records: u64,
    /// Nothing of the topic is dispatched until it is resumed.
    pub paused: bool,
    /// Set aside after `dispatch.max_attempts` failed publishes; wait for a redrive.
    pub parked: u64,
    /// Jobs with a recorded failed publish (parked ones included).
    pub failing: u64,
    /// The webhook target its jobs go to; absent: the ready exchange.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Due jobs the topic's rate limit holds back now.
    pub throttled: u64,
    /// The rate limit in force; `null`: unlimited.
    pub rate_limit: Option<RateLimitFields>,
    /// Its webhook target's breaker holds its jobs; `null`: nothing does (no target, or
    /// the target is closed).
    pub held_by: Option<HeldBy>,
}

/// A rate limit as both faces show it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RateLimitFields {
    pub max_per_second: f64,
    pub burst: u32,
    /// `live` (set through the API or the CLI, stored in Redis) or `policy` (the
    /// configuration's `[[policies]]`).
    pub source: RateSource,
}

impl RateLimitFields {
    pub fn new(limit: Option<(RateLimit, RateSource)>) -> Option<Self> {
        limit.map(|(limit, source)| Self {
            max_per_second: limit.max_per_second,
            burst: limit.burst,
            source,
        })
    }
}

/// A topic's rate limit: `GET`, `PUT` and `DELETE /v1/topics/{topic}/rate-limit`,
/// `redisched rate-limit --json`.
#[derive(Debug, Clone, Serialize)]
pub struct RateLimitView {
    pub topic: Topic,
    /// The limit in force after the call; `null`: unlimited.
    pub rate_limit: Option<RateLimitFields>,
    /// Due jobs it holds back now.
    pub throttled: u64,
    /// Whether the call changed the live limit (a delete of none: `false`).
    pub changed: bool,
}

impl RateLimitView {
    pub fn new(topic: &Topic, state: &RateState, changed: bool) -> Self {
        Self {
            topic: topic.clone(),
            rate_limit: RateLimitFields::new(state.limit),
            throttled: state.throttled,
            changed,
        }
    }
}

impl StatsRow {
    pub fn new(topic: &Topic, stats: &TopicStats) -> Self {
        Self {
            topic: topic.clone(),
            scheduled: stats.scheduled,
            due_now: stats.due_now,
            reserved: stats.reserved,
            expired: stats.expired,
            records: stats.records,
            paused: stats.paused,
            parked: stats.parked,
            failing: stats.failing,
            throttled: stats.throttled,
            rate_limit: RateLimitFields::new(stats.rate_limit),
            target: None,
            held_by: None,
        }
    }
}

/// `GET /v1/topics`, `redisched stats --json`.
#[derive(Debug, Clone, Serialize)]
pub struct TopicsView {
    pub topics: Vec<StatsRow>,
}

impl TopicsView {
    pub fn new(rows: &[(Topic, TopicStats)]) -> Self {
        Self {
            topics: rows.iter().map(|(t, s)| StatsRow::new(t, s)).collect(),
        }
    }

    /// Names each topic's webhook target.
    pub fn with_targets(mut self, targets: &[TargetConfig]) -> Self {
        for row in &mut self.topics {
            row.target = target_for(targets, row.topic.as_str()).map(|(_, t)| t.name.clone());
        }
        self
    }

    /// Fills each topic's `held_by` from every target's breaker (`health`: by target
    /// name, as `Store::targets_health` reads it).
    pub fn with_held_by(
        mut self,
        targets: &[TargetConfig],
        health: &[(String, crate::store::TargetHealth)],
    ) -> Self {
        for row in &mut self.topics {
            row.held_by = HeldBy::of(targets, health, row.topic.as_str());
        }
        self
    }
}

/// One webhook target: a row of `GET /v1/targets` and `redisched targets --json`. The
/// live fields come from the bridge answering (`GET /v1/targets`); the CLI, which
/// talks to Redis only, leaves them out.
#[derive(Debug, Clone, Serialize)]
pub struct TargetRow {
    pub name: String,
    pub topics: Vec<String>,
    pub url: String,
    pub body: String,
    pub max_in_flight: usize,
    pub timeout_ms: u64,
    pub signed: bool,
    pub allowed_url_prefixes: Vec<String>,
    /// Whether a job's own URL may reach private and loopback addresses.
    pub allow_private_job_urls: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub live: Option<TargetStatus>,
    /// A target whose latest attempts failed (the dashboard shows it in red).
    pub failing: bool,
    /// What Redis holds for the target's topics, across every bridge (`redisched
    /// targets`, which talks to Redis, not to a bridge).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backlog: Option<TargetBacklog>,
    /// Its breaker, shared by every bridge (from Redis).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub health: Option<TargetHealthFields>,
}

/// A target's breaker as `GET /v1/targets` and `redisched targets` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TargetHealthFields {
    /// `closed`, `open`, `half_open` or `disabled`.
    pub state: String,
    /// Its topics' jobs wait, scheduled, spending no attempts (all but `closed`;
    /// `half_open` sends one probe).
    pub held_by_breaker: bool,
    pub state_reason: String,
    pub state_changed_at: Option<i64>,
    pub state_changed_at_rfc3339: Option<String>,
    /// Opens in a row with no `closed` between (`disable_after_trips` disables).
    pub trips: u64,
    /// The breaker's current window: requests and failures counted.
    pub window_requests: u64,
    pub window_failures: u64,
}

impl TargetHealthFields {
    pub fn new(h: &crate::store::TargetHealth) -> Self {
        let changed = (h.changed_at > 0).then_some(h.changed_at);
        Self {
            state: h.state.as_str().to_owned(),
            held_by_breaker: h.state.holds(),
            state_reason: h.reason.clone(),
            state_changed_at: changed,
            state_changed_at_rfc3339: changed.map(rfc3339),
            trips: h.trips,
            window_requests: h.requests,
            window_failures: h.failures,
        }
    }
}

/// `POST /v1/targets/{name}/enable` and `…/disable`, `redisched targets enable|disable`.
#[derive(Debug, Clone, Serialize)]
pub struct TargetStateChanged {
    pub target: String,
    #[serde(flatten)]
    pub health: TargetHealthFields,
}

/// A target's jobs in Redis, summed over the known topics it serves (the first target
/// whose patterns match a topic serves it): `reserved` are the requests in flight on
/// every bridge together, `failing` the jobs whose last attempt failed, `parked` those
/// that gave up after `dispatch.max_attempts`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TargetBacklog {
    pub topics: u64,
    pub scheduled: u64,
    pub due_now: u64,
    pub reserved: u64,
    pub failing: u64,
    pub parked: u64,
}

/// `GET /v1/targets`, `redisched targets --json`.
#[derive(Debug, Clone, Serialize)]
pub struct TargetsView {
    pub targets: Vec<TargetRow>,
}

impl TargetsView {
    /// `status` gives a target's live state, when this process runs it.
    pub fn new(targets: &[TargetConfig], status: impl Fn(&str) -> Option<TargetStatus>) -> Self {
        Self {
            targets: targets
                .iter()
                .map(|t| {
                    let live = status(&t.name);
                    TargetRow {
                        name: t.name.clone(),
                        topics: t.topics.clone(),
                        url: crate::urls::redact_url(&t.url),
                        body: t.body.clone(),
                        max_in_flight: t.max_in_flight,
                        timeout_ms: t.timeout_ms,
                        signed: !t.signing_secrets.is_empty(),
                        allowed_url_prefixes: t.allowed_url_prefixes.clone(),
                        allow_private_job_urls: t.allow_private_job_urls,
                        failing: live.as_ref().is_some_and(|s| s.consecutive_failures > 0),
                        live,
                        backlog: None,
                        health: None,
                    }
                })
                .collect(),
        }
    }

    /// Fills each target's breaker fields (`health`: by target name).
    pub fn with_health(mut self, health: &[(String, crate::store::TargetHealth)]) -> Self {
        for row in &mut self.targets {
            if let Some((_, h)) = health.iter().find(|(n, _)| *n == row.name) {
                row.health = Some(TargetHealthFields::new(h));
            }
        }
        self
    }

    /// Fills each target's [`TargetBacklog`] from the topics' counts.
    pub fn with_backlog(mut self, targets: &[TargetConfig], rows: &[(Topic, TopicStats)]) -> Self {
        for row in &mut self.targets {
            row.backlog = Some(TargetBacklog::default());
        }
        for (topic, stats) in rows {
            let Some((_, target)) = target_for(targets, topic.as_str()) else {
                continue;
            };
            let Some(row) = self.targets.iter_mut().find(|r| r.name == target.name) else {
                continue;
            };
            if let Some(backlog) = row.backlog.as_mut() {
                backlog.topics += 1;
                backlog.scheduled += stats.scheduled;
                backlog.due_now += stats.due_now;
                backlog.reserved += stats.reserved;
                backlog.failing += stats.failing;
                backlog.parked += stats.parked;
            }
        }
        self
    }
}

/// The answer to a put (`PUT /v1/topics/{topic}/jobs/{id}`, `redisched put --json`).
#[derive(Debug, Clone, Serialize)]
pub struct PutView {
    pub topic: String,
    pub id: String,
    pub status: PutStatus,
    pub due_at: i64,
    pub due_at_rfc3339: String,
    /// Size of the body sent with this put.
    pub body_bytes: usize,
}

impl PutView {
    pub fn new(topic: &str, id: &str, outcome: &PutOutcome, body_bytes: usize) -> Self {
        Self {
            topic: topic.to_string(),
            id: id.to_string(),
            status: outcome.status,
            due_at: outcome.due_at,
            due_at_rfc3339: rfc3339(outcome.due_at),
            body_bytes,
        }
    }
}

/// The answer to a delete that removed a job.
#[derive(Debug, Clone, Serialize)]
pub struct DeleteView {
    pub topic: String,
    pub id: String,
    pub deleted: bool,
}

impl DeleteView {
    pub fn deleted(topic: &str, id: &str) -> Self {
        Self {
            topic: topic.to_string(),
            id: id.to_string(),
            deleted: true,
        }
    }
}

/// The answer to a cancel by id prefix: how many jobs went, in all and per topic (the
/// topics that had none are left out).
#[derive(Debug, Clone, Serialize)]
pub struct PrefixDeleteView {
    pub id_prefix: String,
    pub all_topics: bool,
    pub deleted: u64,
    pub topics: Vec<PrefixDeleteRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefixDeleteRow {
    pub topic: String,
    pub deleted: u64,
}

impl PrefixDeleteView {
    pub fn new(prefix: &IdPrefix, all_topics: bool, deleted: &[(Topic, u64)]) -> Self {
        Self {
            id_prefix: prefix.to_string(),
            all_topics,
            deleted: deleted.iter().map(|(_, n)| n).sum(),
            topics: deleted
                .iter()
                .filter(|(_, n)| *n > 0 || !all_topics)
                .map(|(topic, n)| PrefixDeleteRow {
                    topic: topic.to_string(),
                    deleted: *n,
                })
                .collect(),
        }
    }
}

/// A recurring job's schedule: `every_ms`, or `cron` and `tz`; none of them for a
/// one-shot job (the fields are left out). A spec another client wrote in a convention
/// of its own shows as `spec`, as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ScheduleFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tz: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<String>,
}

impl ScheduleFields {
    /// The fields of a stored spec (`None`: a one-shot job).
    pub fn of(spec: Option<&str>) -> Self {
        let Some(raw) = spec else {
            return Self::default();
        };
        let other = || Self {
            spec: Some(raw.to_string()),
            ..Self::default()
        };
        let Ok(spec) = ScheduleSpec::new(raw) else {
            return other();
        };
        match spec.kind() {
            SpecKind::Every { interval_ms } => Self {
                every_ms: Some(interval_ms),
                ..Self::default()
            },
            SpecKind::Cron { expr, tz } => Self {
                cron: Some(expr.to_string()),
                tz: Some(tz.to_string()),
                ..Self::default()
            },
            SpecKind::Other(_) => other(),
        }
    }

    /// For people: `every 15m`, `cron 0 9 * * MON-FRI (Europe/Berlin)`; `None` for a
    /// one-shot job.
    pub fn describe(&self) -> Option<String> {
        if let Some(ms) = self.every_ms {
            return Some(format!(
                "every {}",
                humantime::format_duration(Duration::from_millis(ms))
            ));
        }
        if let Some(cron) = &self.cron {
            return Some(format!(
                "cron {cron} ({})",
                self.tz.as_deref().unwrap_or("UTC")
            ));
        }
        self.spec.as_ref().map(|spec| format!("spec {spec}"))
    }
}

/// A job's failed publishes: how many (of this occurrence, for a series) and the last
/// one's reason and time (`null` when it never failed).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FailureFields {
    pub failures: u32,
    pub last_error: Option<String>,
    pub last_error_at: Option<i64>,
    pub last_error_at_rfc3339: Option<String>,
}

impl FailureFields {
    pub fn new(failures: u32, last_error: Option<&LastError>) -> Self {
        Self {
            failures,
            last_error: last_error.map(|e| e.reason.clone()),
            last_error_at: last_error.map(|e| e.at),
            last_error_at_rfc3339: last_error.map(|e| rfc3339(e.at)),
        }
    }
}

/// One job in a list: waiting (earliest first) or parked (by id).
#[derive(Debug, Clone, Serialize)]
pub struct ListRow {
    pub id: String,
    pub state: JobState,
    pub due_at: i64,
    pub due_at_rfc3339: String,
    pub attempts: u32,
    #[serde(flatten)]
    pub schedule: ScheduleFields,
    #[serde(flatten)]
    pub failure: FailureFields,
}

/// `GET /v1/topics/{topic}/jobs`, `redisched list --json`: the next scheduled jobs,
/// earliest first (or the parked ones), with the server's clock when they were read.
#[derive(Debug, Clone, Serialize)]
pub struct ListView {
    pub topic: Topic,
    pub now: i64,
    pub jobs: Vec<ListRow>,
}

impl ListView {
    pub fn new(topic: &Topic, now: i64, jobs: &[JobSummary]) -> Self {
        Self {
            topic: topic.clone(),
            now,
            jobs: jobs
                .iter()
                .map(|job| ListRow {
                    id: job.id.clone(),
                    state: job.state,
                    due_at: job.due_at,
                    due_at_rfc3339: rfc3339(job.due_at),
                    attempts: job.attempts,
                    schedule: ScheduleFields::of(job.spec.as_deref()),
                    failure: FailureFields::new(job.failures, job.last_error.as_ref()),
                })
                .collect(),
        }
    }
}

/// One job (`GET /v1/topics/{topic}/jobs/{id}`, `redisched get --json`). The body is
/// UTF-8 text when it is valid UTF-8 (`"encoding": "utf-8"`), base64 otherwise
/// (`"encoding": "base64"`).
#[derive(Debug, Clone, Serialize)]
pub struct JobView {
    pub topic: Topic,
    pub id: String,
    pub state: JobState,
    pub due_at: i64,
    pub due_at_rfc3339: String,
    pub attempts: u32,
    pub deadline: Option<i64>,
    pub body: String,
    pub encoding: &'static str,
    pub body_bytes: usize,
    #[serde(flatten)]
    pub schedule: ScheduleFields,
    /// A jittered series' `x-redisched-jitter` (ms, from its stored properties).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jitter_ms: Option<u64>,
    #[serde(flatten)]
    pub failure: FailureFields,
    /// The job's own expiry, ms after its due time (`x-redisched-expires-after`, REST
    /// and CLI `expires_after`); absent: none of its own (its topic's `[[policies]]`
    /// default applies, if any).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_after: Option<u64>,
}

impl JobView {
    pub fn new(topic: &Topic, id: &str, info: &JobInfo) -> Self {
        let (body, encoding) = match std::str::from_utf8(&info.body) {
            Ok(text) => (text.to_string(), "utf-8"),
            Err(_) => (
                base64::engine::general_purpose::STANDARD.encode(&info.body),
                "base64",
            ),
        };
        Self {
            topic: topic.clone(),
            id: id.to_string(),
            state: info.state,
            due_at: info.due_at,
            due_at_rfc3339: rfc3339(info.due_at),
            attempts: info.attempts,
            deadline: info.deadline,
            body,
            encoding,
            body_bytes: info.body.len(),
            schedule: ScheduleFields::of(info.spec.as_deref()),
            jitter_ms: info
                .spec
                .as_ref()
                .and_then(|_| crate::job::meta::decode_meta(&info.meta).ok())
                .map(|props| crate::job::meta::jitter_of(&props))
                .filter(|&ms| ms > 0),
            failure: FailureFields::new(info.failures, info.last_error.as_ref()),
            expires_after: crate::job::meta::decode_meta(&info.meta)
                .ok()
                .and_then(|props| crate::job::expiry::of_job(&props).ok().flatten()),
        }
    }
}

/// `POST /v1/topics/{topic}/pause` and `/resume`, `redisched pause|resume --json`.
#[derive(Debug, Clone, Serialize)]
pub struct PauseView {
    pub topic: Topic,
    /// The state now.
    pub paused: bool,
    /// `false` when the topic was in that state already.
    pub changed: bool,
}

/// A redrive (`POST …/jobs/{id}/redrive`, `POST …/redrive`, `redisched redrive --json`):
/// how many parked jobs were made due now.
#[derive(Debug, Clone, Serialize)]
pub struct RedriveView {
    pub topic: Topic,
    /// The one job asked for; left out for a whole-topic redrive.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub redriven: u64,
}

/// One outcome of a topic's history.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryRow {
    pub at: i64,
    pub at_rfc3339: String,
    pub outcome: Outcome,
    pub id: String,
    pub attempts: u32,
    pub due_at: i64,
    pub due_at_rfc3339: String,
    /// The next due time (epoch ms) after a dispatched occurrence of a series, the error
    /// of a `parked` outcome, else empty.
    pub detail: String,
}

/// `GET /v1/topics/{topic}/history`, `redisched history --json`: newest first.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryView {
    pub topic: Topic,
    /// The job asked for; left out when the whole topic was asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub entries: Vec<HistoryRow>,
}

impl HistoryView {
    pub fn new(topic: &Topic, id: Option<&JobId>, entries: &[HistoryEntry]) -> Self {
        Self {
            topic: topic.clone(),
            id: id.map(|id| id.to_string()),
            entries: entries
                .iter()
                .map(|e| HistoryRow {
                    at: e.at,
                    at_rfc3339: rfc3339(e.at),
                    outcome: e.outcome,
                    id: e.id.clone(),
                    attempts: e.attempts,
                    due_at: e.due_at,
                    due_at_rfc3339: rfc3339(e.due_at),
                    detail: e.detail.clone(),
                })
                .collect(),
        }
    }
}

/// Why a redrive of one job moved nothing, for both faces: whether the job exists (it is
/// then not parked: 409 / exit 1), and the message.
pub fn not_parked(topic: &Topic, id: &JobId, info: Option<&JobInfo>) -> (bool, String) {
    match info {
        None => (false, no_such_job(topic, id)),
        Some(info) => (
            true,
            format!(
                "job {id} in topic {topic} is not parked (it is {}); only parked jobs are re-driven",
                to_json(&info.state).as_str().unwrap_or("?")
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_show_as_every_ms_or_cron_and_tz() {
        let cron = crate::job::schedule::Schedule::cron("0 9 * * MON-FRI", Some("Europe/Berlin"))
            .expect("valid cron");
        assert_eq!(
            serde_json::to_value(ScheduleFields::of(Some(&cron.to_spec()))).unwrap(),
            serde_json::json!({"cron": "0 9 * * MON-FRI", "tz": "Europe/Berlin"})
        );
        let every = crate::job::schedule::Schedule::Every { ms: 5 };
        assert_eq!(
            serde_json::to_value(ScheduleFields::of(Some(&every.to_spec()))).unwrap(),
            serde_json::json!({"every_ms": 5})
        );
        assert_eq!(
            serde_json::to_value(ScheduleFields::of(None)).unwrap(),
            serde_json::json!({})
        );
    }

    #[test]
    fn times_and_states_read_as_people_write_them() {
        assert_eq!(rfc3339(1000), "1970-01-01T00:00:01.000Z");
        assert_eq!(
            no_such_job(&Topic::new("t").unwrap(), &JobId::new("a b").unwrap()),
            "no job a b in topic t"
        );
        assert_eq!(rfc3339(i64::MAX), i64::MAX.to_string());
        assert_eq!(rfc3339(-1), "-1");
        assert_eq!(rfc3339(YEAR_10000_MS - 1), "9999-12-31T23:59:59.999Z");
        assert_eq!(to_json(&JobState::Unindexed), "unindexed");
        let job = JobSummary {
            id: "a".into(),
            due_at: 1000,
            state: JobState::Parked,
            attempts: 3,
            spec: Some("cron:0 9 * * MON-FRI|Europe/Berlin".into()),
            failures: 3,
            last_error: Some(LastError {
                reason: "unroutable: NO_ROUTE".into(),
                at: 2000,
            }),
        };
        let row = &to_json(&ListView::new(&Topic::new("t").unwrap(), 5, &[job]))["jobs"][0];
        assert_eq!(row["due_at_rfc3339"], "1970-01-01T00:00:01.000Z");
        assert_eq!(row["state"], "parked");
        assert_eq!(row["cron"], "0 9 * * MON-FRI");
        assert_eq!(row["tz"], "Europe/Berlin");
        assert!(row.get("every_ms").is_none(), "{row}");
        assert_eq!(row["last_error"], "unroutable: NO_ROUTE");
        assert_eq!(row["last_error_at"], 2000);
    }

    #[test]
    fn schedules_read_back_for_people() {
        let every = ScheduleFields::of(Some("every:900000"));
        assert_eq!(every.every_ms, Some(900_000));
        assert_eq!(every.describe().as_deref(), Some("every 15m"));
        let cron = ScheduleFields::of(Some("cron:*/2 * * * * *|UTC"));
        assert_eq!(cron.describe().as_deref(), Some("cron */2 * * * * * (UTC)"));
        let other = ScheduleFields::of(Some("weekly"));
        assert_eq!(other.spec.as_deref(), Some("weekly"));
        assert_eq!(ScheduleFields::of(None), ScheduleFields::default());
        assert_eq!(ScheduleFields::of(None).describe(), None);
        let one_shot = to_json(&ScheduleFields::default());
        assert_eq!(
            one_shot,
            serde_json::json!({}),
            "one-shot jobs carry no schedule fields"
        );
        let never = to_json(&FailureFields::new(0, None));
        assert_eq!(never["last_error"], serde_json::Value::Null);
    }
}

//! What the faces show: the JSON of the HTTP API and of `redisched … --json`, one
//! serializable view per thing, so the two answer the same thing identically. Also
//! the one place that formats times for people (RFC 3339).

use std::time::{Duration, UNIX_EPOCH};

use base64::Engine as _;
use serde::Serialize;

use crate::job::{JobId, Topic};
use crate::store::{JobInfo, JobState, PutOutcome, PutStatus, TopicStats};

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

/// One scheduled job in a list.
#[derive(Debug, Clone, Serialize)]
pub struct ListRow {
    pub id: String,
    pub due_at: i64,
    pub due_at_rfc3339: String,
}

/// `GET /v1/topics/{topic}/jobs`, `redisched list --json`: the next scheduled jobs,
/// earliest first, with the server's clock when they were read.
#[derive(Debug, Clone, Serialize)]
pub struct ListView {
    pub topic: Topic,
    pub now: i64,
    pub jobs: Vec<ListRow>,
}

impl ListView {
    pub fn new(topic: &Topic, now: i64, jobs: &[(String, i64)]) -> Self {
        Self {
            topic: topic.clone(),
            now,
            jobs: jobs
                .iter()
                .map(|(id, due_at)| ListRow {
                    id: id.clone(),
                    due_at: *due_at,
                    due_at_rfc3339: rfc3339(*due_at),
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let row = ListView::new(&Topic::new("t").unwrap(), 5, &[("a".into(), 1000)]);
        assert_eq!(
            to_json(&row)["jobs"][0]["due_at_rfc3339"],
            "1970-01-01T00:00:01.000Z"
        );
    }
}

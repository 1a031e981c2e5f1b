//! The read commands: `get`, `list`, `stats` and `history`.

use crate::job::{JobId, Topic};
use crate::store::{JobState, ListWhich, RateSource, Store, TopicStats, MAX_BATCH};
use crate::view::{self, rfc3339, HeldBy, HistoryView, JobView, ListView, TopicsView};

use super::output::{relative, Output};
use super::{CliError, JobRef};

pub(super) async fn get(store: &Store, job: &JobRef) -> Result<Output, CliError> {
    let info = store
        .get(&job.topic, &job.id)
        .await?
        .ok_or_else(|| CliError::NotFound(view::no_such_job(&job.topic, &job.id)))?;
    let now = store.server_time().await?;
    let job_view = JobView::new(&job.topic, job.id.as_str(), &info);
    let json = view::to_json(&job_view);
    let state = json["state"].as_str().unwrap_or("?");
    let mut human = String::new();
    // A failing or parked job leads with it, so it cannot be missed.
    if info.state == JobState::Parked {
        human.push_str(&format!(
            "!! PARKED after {} failed publish(es); `redisched redrive {} {}` makes it due now\n",
            info.failures, job.topic, job.id
        ));
    } else if let Some(error) = &info.last_error {
        human.push_str(&format!(
            "!! FAILING: {} failed publish(es), last {} ({})\n",
            info.failures,
            error.reason,
            relative(error.at, now)
        ));
    }
    human.push_str(&format!(
        "topic     {}\nid        {}\nstate     {state}\n",
        job.topic, job.id
    ));
    if let Some(schedule) = job_view.schedule.describe() {
        human.push_str(&format!("schedule  {schedule}\n"));
    }
    let due_label = if info.spec.is_some() {
        "next due"
    } else {
        "due at"
    };
    human.push_str(&format!(
        "{due_label:<10}{} ({})\nattempts  {}\n",
        rfc3339(info.due_at),
        relative(info.due_at, now),
        info.attempts,
    ));
    if let Some(deadline) = info.deadline {
        human.push_str(&format!(
            "deadline  {} ({})\n",
            rfc3339(deadline),
            relative(deadline, now)
        ));
    }
    if let Some(error) = &info.last_error {
        human.push_str(&format!(
            "failures  {}\nlast error {} at {} ({})\n",
            info.failures,
            error.reason,
            rfc3339(error.at),
            relative(error.at, now)
        ));
    }
    match std::str::from_utf8(&info.body) {
        Ok(text) => human.push_str(&format!("body      ({} bytes)\n{text}", info.body.len())),
        Err(_) => human.push_str(&format!(
            "body      ({} bytes, not UTF-8, base64)\n{}",
            info.body.len(),
            json["body"].as_str().unwrap_or("")
        )),
    }
    Ok(Output {
        json,
        human: human.trim_end().to_string(),
    })
}

pub(super) async fn list(
    store: &Store,
    topic: &Topic,
    limit: usize,
    offset: usize,
    which: ListWhich,
) -> Result<Output, CliError> {
    check_limit(limit)?;
    let jobs = store.list_jobs(topic, which, limit, offset).await?;
    let now = store.server_time().await?;
    let view = ListView::new(topic, now, &jobs);
    let json = view::to_json(&view);
    let human = if view.jobs.is_empty() {
        match which {
            ListWhich::Scheduled => format!("no scheduled jobs in topic {topic}"),
            ListWhich::Parked => format!("no parked jobs in topic {topic}"),
        }
    } else {
        let width = view
            .jobs
            .iter()
            .map(|job| job.id.len())
            .max()
            .unwrap_or(2)
            .max(2);
        let schedules: Vec<String> = view
            .jobs
            .iter()
            .map(|job| job.schedule.describe().unwrap_or_else(|| "-".into()))
            .collect();
        let swidth = schedules.iter().map(String::len).max().unwrap_or(8).max(8);
        let mut out = format!(
            "{:<width$}  {:<24}  {:<14}  {:<9}  {:>8}  {:<swidth$}  LAST ERROR\n",
            "ID", "DUE AT", "IN", "STATE", "ATTEMPTS", "SCHEDULE"
        );
        for (job, schedule) in view.jobs.iter().zip(&schedules) {
            let state = view::to_json(&job.state);
            // A job whose last publish failed (parked ones too) is marked `!!`.
            let error = match (&job.failure.last_error, job.failure.last_error_at) {
                (Some(reason), Some(at)) => format!(
                    "!! {reason} ({} failure(s), last {})",
                    job.failure.failures,
                    relative(at, now)
                ),
                _ => String::new(),
            };
            let line = format!(
                "{:<width$}  {:<24}  {:<14}  {:<9}  {:>8}  {schedule:<swidth$}  {error}",
                job.id,
                job.due_at_rfc3339,
                relative(job.due_at, now),
                state.as_str().unwrap_or("?"),
                job.attempts,
            );
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.trim_end().to_string()
    };
    Ok(Output { json, human })
}

pub(super) fn check_limit(limit: usize) -> Result<(), CliError> {
    if (1..=MAX_BATCH).contains(&limit) {
        Ok(())
    } else {
        Err(CliError::Usage(format!(
            "--limit must be 1..={MAX_BATCH}, got {limit}"
        )))
    }
}

pub(super) async fn stats(
    store: &Store,
    topic: Option<&Topic>,
    targets: &[crate::targets::TargetConfig],
) -> Result<Output, CliError> {
    let topics = match topic {
        Some(topic) => vec![topic.clone()],
        None => store.topics().await?,
    };
    let mut rows = Vec::with_capacity(topics.len());
    for topic in topics {
        let stats = store.stats(&topic).await?;
        rows.push((topic, stats));
    }
    let health = store.targets_health(targets).await?;
    let view = TopicsView::new(&rows)
        .with_targets(targets)
        .with_held_by(targets, &health);
    let held: Vec<String> = view
        .topics
        .iter()
        .map(|row| HeldBy::describe(row.held_by.as_ref()))
        .collect();
    Ok(Output {
        json: view::to_json(&view),
        human: stats_table(&rows, &held),
    })
}

/// The human `stats`: one row per topic; `held` is each topic's `HELD BY` cell.
fn stats_table(rows: &[(Topic, TopicStats)], held: &[String]) -> String {
    if rows.is_empty() {
        "no topics yet".to_string()
    } else {
        let width = rows
            .iter()
            .map(|(t, _)| t.as_str().len())
            .max()
            .unwrap_or(5)
            .max(5);
        let limits: Vec<String> = rows
            .iter()
            .map(|(_, s)| match s.rate_limit {
                Some((limit, RateSource::Live)) => limit.to_string(),
                Some((limit, RateSource::Policy)) => format!("{limit} (policy)"),
                None => "-".into(),
            })
            .collect();
        let limit_width = limits.iter().map(String::len).max().unwrap_or(1).max(10);
        let held_width = held.iter().map(String::len).max().unwrap_or(1).max(7);
        // PAUSED stays last: scripts read a paused topic's row as ending in `yes`.
        let mut out = format!(
            "{:<width$}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}  {:>9}  {:<limit_width$}  {:<held_width$}  {:>6}\n",
            "TOPIC",
            "SCHEDULED",
            "DUE NOW",
            "RESERVED",
            "PARKED",
            "FAILING",
            "THROTTLED",
            "RATE LIMIT",
            "HELD BY",
            "PAUSED"
        );
        for (((topic, s), limit), held) in rows.iter().zip(&limits).zip(held) {
            out.push_str(&format!(
                "{:<width$}  {:>10}  {:>10}  {:>10}  {:>8}  {:>8}  {:>9}  {:<limit_width$}  {:<held_width$}  {:>6}\n",
                topic.as_str(),
                s.scheduled,
                s.due_now,
                s.reserved,
                s.parked,
                s.failing,
                s.throttled,
                limit,
                held,
                if s.paused { "yes" } else { "no" },
            ));
        }
        out.trim_end().to_string()
    }
}

pub(super) async fn history(
    store: &Store,
    topic: &Topic,
    id: Option<&JobId>,
    limit: usize,
) -> Result<Output, CliError> {
    check_limit(limit)?;
    let entries = store.history(topic, id, limit).await?;
    let now = store.server_time().await?;
    let view = HistoryView::new(topic, id, &entries);
    let json = view::to_json(&view);
    let human = if view.entries.is_empty() {
        match id {
            Some(id) => format!("no history of job {id} in topic {topic}"),
            None => format!("no history in topic {topic}"),
        }
    } else {
        let width = view
            .entries
            .iter()
            .map(|e| e.id.len())
            .max()
            .unwrap_or(2)
            .max(2);
        let mut out = format!(
            "{:<24}  {:<14}  {:<10}  {:<width$}  {:>8}  {:<24}  DETAIL\n",
            "AT", "", "OUTCOME", "ID", "ATTEMPTS", "DUE AT"
        );
        for e in &view.entries {
            // A series' next due time, then a delivery note (a webhook's `HTTP 200`).
            let (head, note) = e.detail.split_once(' ').unwrap_or((&e.detail, ""));
            let detail = match head.parse::<i64>() {
                Ok(next) if e.outcome == crate::store::Outcome::Dispatched => {
                    format!("next {} {note}", rfc3339(next))
                        .trim_end()
                        .to_owned()
                }
                _ => e.detail.clone(),
            };
            let line = format!(
                "{:<24}  {:<14}  {:<10}  {:<width$}  {:>8}  {:<24}  {detail}",
                e.at_rfc3339,
                relative(e.at, now),
                e.outcome.as_str(),
                e.id,
                e.attempts,
                e.due_at_rfc3339,
            );
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.trim_end().to_string()
    };
    Ok(Output { json, human })
}

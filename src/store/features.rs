//! The scheduler features over the Lua scripts: recurring series (a schedule
//! spec on the job, release to the next occurrence: `api.rs`), pause and resume, failing
//! and parked jobs with redrive, and the outcome history. Contract: `lua/README.md`;
//! request and reply types in `types.rs`.

use std::time::Duration;

use redis::Value;

use super::api::{last_error, non_empty};
use super::reply::Reader;
use super::scripts::Scripts;
use super::types::{
    Applied, Command, HistoryEntry, JobState, JobSummary, Lease, ListWhich, Op, Outcome,
    PutOutcome, PutRequest, Redriven, RetryOutcome, ScheduleSpec, MAX_BATCH,
};
use super::{Store, StoreError};
use crate::job::{JobId, Topic};

/// Longest failure reason `retry.lua` stores; longer ones are cut here, not refused.
const MAX_ERROR_BYTES: usize = 256;

/// At most [`MAX_ERROR_BYTES`], cut at a character boundary.
fn short_reason(reason: &str) -> &str {
    if reason.len() <= MAX_ERROR_BYTES {
        return reason;
    }
    let mut end = MAX_ERROR_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

fn count_of(reply: &mut Reader, what: &str) -> Result<u64, StoreError> {
    Ok(u64::try_from(reply.int(what)?).unwrap_or(0))
}

impl Store {
    /// Stores a recurring job (mode nx or replace, as for [`Store::put`]); `request.due`
    /// is its first occurrence.
    pub async fn put_recurring(
        &self,
        request: PutRequest,
        schedule: ScheduleSpec,
    ) -> Result<PutOutcome, StoreError> {
        self.put_jittered(request, schedule, 0).await
    }

    /// [`Store::put_recurring`] with a jitter: the first occurrence waits in the
    /// schedule for a delay in `[0, jitter_ms)` derived from topic, id and its due
    /// time (`lua/put.lua`; `jitter_ms` is the bound, `Schedule::jitter_bound`).
    pub async fn put_jittered(
        &self,
        request: PutRequest,
        schedule: ScheduleSpec,
        jitter_ms: u64,
    ) -> Result<PutOutcome, StoreError> {
        let command = Command {
            op: Op::Put(request),
            schedule: Some(schedule),
            jitter_ms,
        };
        let mut results = self.apply_commands(std::slice::from_ref(&command)).await?;
        match results.pop() {
            Some(Ok(Applied::Put(outcome))) => Ok(outcome),
            Some(Err(rejection)) => Err(rejection.into()),
            _ => Err(StoreError::bad_reply("put", "no put reply")),
        }
    }

    /// Hands a reserved job back after a failed publish, recording `reason` (cut to 256
    /// bytes) and the server's time on it; parks it when its recorded failures reach
    /// `max_attempts` (0 = never). See `lua/retry.lua`.
    pub async fn retry_failed(
        &self,
        lease: &Lease,
        delay: Duration,
        reason: &str,
        max_attempts: u32,
    ) -> Result<RetryOutcome, StoreError> {
        let topic = &lease.topic;
        let call = Scripts::call(&self.exec.scripts().retry, topic, &self.keys)
            .arg(lease.id.as_str())
            .arg(lease.token)
            .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))
            .arg(short_reason(reason))
            .arg(max_attempts)
            .arg(self.history_max);
        let moved: i64 = redis::from_redis_value(self.exec.run_one(call).await?)
            .map_err(|e| StoreError::bad_reply("retry", e.to_string()))?;
        match moved {
            0 => Ok(RetryOutcome::Stale),
            1 => Ok(RetryOutcome::Retried),
            2 => Ok(RetryOutcome::Parked),
            other => Err(StoreError::bad_reply("retry", format!("reply {other}"))),
        }
    }

    /// Pauses a topic (jobs or not): nothing of it is reserved or pulled until
    /// [`Store::resume`]; `false` if it was paused already. Registers the topic, so a
    /// topic paused before its first job is listed. See `lua/pause.lua`.
    pub async fn pause(&self, topic: &Topic) -> Result<bool, StoreError> {
        self.register_now(&[topic]).await?;
        let call = Scripts::call(&self.exec.scripts().pause, topic, &self.keys);
        Ok(self.exec.run_one(call).await? == Value::Int(1))
    }

    /// Resumes a paused topic and wakes the dispatchers (Pub/Sub on the notify channel);
    /// `false` if it was not paused. See `lua/resume.lua`.
    pub async fn resume(&self, topic: &Topic) -> Result<bool, StoreError> {
        let call = Scripts::call(&self.exec.scripts().resume, topic, &self.keys)
            .arg(self.keys.notify_channel());
        Ok(self.exec.run_one(call).await? == Value::Int(1))
    }

    pub async fn is_paused(&self, topic: &Topic) -> Result<bool, StoreError> {
        let [.., paused, _, _] = self.keys.all(topic);
        // GET rather than EXISTS: the least-privilege ACL already allows it.
        let since: Option<String> = self.exec.query(redis::cmd("GET").arg(paused)).await?;
        Ok(since.is_some())
    }

    /// Makes one parked job due now (attempts kept); `false` if it was not parked.
    pub async fn redrive(&self, topic: &Topic, id: &JobId) -> Result<bool, StoreError> {
        let step = self.redrive_call(topic, id.as_str(), 1).await?;
        Ok(step.moved == 1)
    }

    /// Makes up to `count` parked jobs of a topic due now; call again while
    /// `remaining > 0` (or use [`Store::redrive_topic`]).
    pub async fn redrive_all(&self, topic: &Topic, count: usize) -> Result<Redriven, StoreError> {
        self.redrive_call(topic, "", count.clamp(1, MAX_BATCH))
            .await
    }

    /// Every parked job of a topic due now, [`MAX_BATCH`] per call; how many moved.
    pub async fn redrive_topic(&self, topic: &Topic) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let step = self.redrive_all(topic, MAX_BATCH).await?;
            total += step.moved;
            // `moved == 0` with jobs left cannot happen; it must not loop forever.
            if step.remaining == 0 || step.moved == 0 {
                return Ok(total);
            }
        }
    }

    async fn redrive_call(
        &self,
        topic: &Topic,
        id: &str,
        count: usize,
    ) -> Result<Redriven, StoreError> {
        let call = Scripts::call(&self.exec.scripts().redrive, topic, &self.keys)
            .arg(id)
            .arg(count)
            .arg(self.keys.notify_channel())
            .arg(self.history_max);
        let mut reply = Reader::new("redrive", self.exec.run_one(call).await?)?;
        Ok(Redriven {
            moved: count_of(&mut reply, "moved")?,
            remaining: count_of(&mut reply, "remaining")?,
        })
    }

    /// A topic's latest outcomes, newest first, optionally of one job. See
    /// `lua/history.lua`.
    pub async fn history(
        &self,
        topic: &Topic,
        id: Option<&JobId>,
        limit: usize,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        let call = Scripts::call(&self.exec.scripts().history, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(id.map_or("", JobId::as_str));
        let value = self.exec.run_one(call).await?;
        let mut entries = Vec::new();
        let mut reply = Reader::new("history", value)?;
        while reply.remaining() > 0 {
            let mut entry = reply.array("entry")?;
            let at = entry.int("at")?;
            let name = entry.string("outcome")?;
            let outcome = Outcome::parse(&name)
                .ok_or_else(|| StoreError::bad_reply("history", format!("outcome {name}")))?;
            entries.push(HistoryEntry {
                at,
                outcome,
                id: String::from_utf8_lossy(&entry.bytes("id")?).into_owned(),
                attempts: u32::try_from(entry.int("attempts")?).unwrap_or(u32::MAX),
                due_at: entry.int("due_at")?,
                detail: String::from_utf8_lossy(&entry.bytes("detail")?).into_owned(),
            });
        }
        Ok(entries)
    }

    /// Waiting or parked jobs with their schedule and failure details (`lua/list.lua`
    /// with `detail`). An entry whose record cannot be read is left out (and logged;
    /// `redisched check` reports it).
    pub async fn list_jobs(
        &self,
        topic: &Topic,
        which: ListWhich,
        limit: usize,
        offset: usize,
    ) -> Result<Vec<JobSummary>, StoreError> {
        let call = Scripts::call(&self.exec.scripts().list, topic, &self.keys)
            .arg(limit.clamp(1, MAX_BATCH))
            .arg(offset)
            .arg(match which {
                ListWhich::Scheduled => "scheduled",
                ListWhich::Parked => "parked",
            })
            .arg("1");
        let value = self.exec.run_one(call).await?;
        let mut jobs = Vec::new();
        let mut reply = Reader::new("list", value)?;
        while reply.remaining() > 0 {
            let mut entry = reply.array("job")?;
            let id = String::from_utf8_lossy(&entry.bytes("id")?).into_owned();
            let due_at = entry.int("due_at")?;
            let state = match entry.string("state")?.as_str() {
                "scheduled" => JobState::Scheduled,
                "parked" => JobState::Parked,
                _ => {
                    tracing::warn!(%topic, %id, "list: unreadable record left out; run `redisched check {topic}`");
                    continue;
                }
            };
            jobs.push(JobSummary {
                id,
                due_at,
                state,
                attempts: u32::try_from(entry.int("attempts")?).unwrap_or(u32::MAX),
                spec: non_empty(&entry.bytes("spec")?),
                failures: u32::try_from(entry.int("failures")?).unwrap_or(u32::MAX),
                last_error: last_error(&mut entry)?,
            });
        }
        Ok(jobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::types::{NextDue, SpecError, SpecKind};

    #[test]
    fn specs_follow_the_convention_and_refuse_what_put_lua_refuses() {
        assert_eq!(ScheduleSpec::every(900_000).as_str(), "every:900000");
        assert_eq!(
            ScheduleSpec::every(5).kind(),
            SpecKind::Every { interval_ms: 5 }
        );
        let cron = ScheduleSpec::cron("0 9 * * MON-FRI", "Europe/Berlin").unwrap();
        assert_eq!(cron.as_str(), "cron:0 9 * * MON-FRI|Europe/Berlin");
        assert_eq!(
            cron.kind(),
            SpecKind::Cron {
                expr: "0 9 * * MON-FRI",
                tz: "Europe/Berlin"
            }
        );
        assert_eq!(
            ScheduleSpec::new("weekly").unwrap().kind(),
            SpecKind::Other("weekly")
        );
        assert_eq!(ScheduleSpec::new(""), Err(SpecError::Length(0)));
        assert_eq!(
            ScheduleSpec::new("a".repeat(257)),
            Err(SpecError::Length(257))
        );
        assert_eq!(ScheduleSpec::new("every:\n5"), Err(SpecError::Control));
        assert_eq!(ScheduleSpec::cron("* * * * *", "a|b"), Err(SpecError::Zone));
    }

    #[test]
    fn leases_carry_the_next_due_time_as_release_lua_reads_it() {
        assert_eq!(NextDue::OneShot.lease_arg(17), "17");
        assert_eq!(NextDue::At(1_000).lease_arg(17), "17@1000");
        assert_eq!(NextDue::End.lease_arg(17), "17@-1");
    }

    #[test]
    fn long_reasons_are_cut_at_a_character_boundary() {
        let reason = "é".repeat(200);
        let cut = short_reason(&reason);
        assert!(cut.len() <= MAX_ERROR_BYTES && cut.len() >= MAX_ERROR_BYTES - 1);
        assert!(reason.starts_with(cut));
        assert_eq!(short_reason("nack"), "nack");
    }
}

//! The reserve, for every sink: one round trip for a group of due topics
//! (`lua/reserve.lua`, which alone decides what is due and applies rate limits), the
//! server clock corrected from its replies (and what they say of each topic kept for
//! the plan's next turn, [`Learned`]), and each job triaged before a sink sees it: its
//! settle [`Ticket`] made (what releasing or handing it back needs, whichever sink
//! delivers it); a series occurrence whose next one cannot be computed failed; an
//! expired job (judged here by the rule of `src/job/expiry.rs`) set aside
//! (`set_aside.rs`). What is left goes to the sink's round as [`Reserved`] jobs, to be
//! sent. While spans are exported, each job also carries its topic's last pause that
//! ended (recorded here, begun with one read of since when the topic is paused), for
//! its delivery span's `redisched.paused_ms`. Here are the reserve methods of [`Core`];
//! the struct itself is in `mod.rs`, beside the turn that builds it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lapin::protocol::basic::AMQPProperties;

use super::Core;
use crate::job::expiry;
use crate::job::meta::{decode_meta, jitter_of};
use crate::job::schedule::Schedule;
use crate::job::Topic;
use crate::policy::Policies;
use crate::store::{Batch, Lease, ReservedJob, StoreError};
use crate::telemetry::{self, Via};

/// Due topics reserved from in one round trip at most.
pub const RESERVE_GROUP: usize = 64;

/// What a capped reserve left of a topic: retries held back by the cap, and whether
/// due jobs went unseen (`false`: every due first attempt was taken).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub retries: u64,
    pub unseen: bool,
}

impl Core<'_> {
    /// Reserves up to `each` jobs of every topic of `group` (keep it to
    /// [`RESERVE_GROUP`]) in one round trip, corrects the clock from the replies (and
    /// keeps what they say for the plan), and returns each topic's jobs to deliver
    /// (expired ones set aside and unreadable series failed already).
    pub async fn reserve(
        &mut self,
        group: &[Topic],
        each: usize,
    ) -> Result<Vec<(Topic, Vec<Reserved>)>, StoreError> {
        let ttr = Duration::from_millis(self.dispatcher.config.dispatch.ttr_ms);
        let sent = Instant::now();
        let batches = self.dispatcher.store.reserve_many(group, ttr, each).await?;
        Ok(self.take(group, batches, sent).await)
    }

    /// [`Core::reserve`] with a retry cap per topic (`caps[i]` for `group[i]`, see
    /// `Store::reserve_many_capped`); beside each topic's jobs, its [`Held`].
    pub async fn reserve_capped(
        &mut self,
        group: &[Topic],
        each: usize,
        caps: &[usize],
    ) -> Result<Vec<(Topic, Vec<Reserved>, Held)>, StoreError> {
        let ttr = Duration::from_millis(self.dispatcher.config.dispatch.ttr_ms);
        let sent = Instant::now();
        let store = &self.dispatcher.store;
        let batches = store.reserve_many_capped(group, ttr, each, caps).await?;
        let held: Vec<Held> = batches
            .iter()
            .map(|b| Held {
                retries: b.held_retries,
                unseen: b.unseen,
            })
            .collect();
        let taken = self.take(group, batches, sent).await;
        Ok(taken
            .into_iter()
            .zip(held)
            .map(|((topic, jobs), held)| (topic, jobs, held))
            .collect())
    }

    /// The clock corrected from `batches` (a reserve of `group` sent at `sent`), what
    /// they say of each topic kept for the plan, and each topic's jobs triaged.
    async fn take(
        &mut self,
        group: &[Topic],
        batches: Vec<Batch>,
        sent: Instant,
    ) -> Vec<(Topic, Vec<Reserved>)> {
        let dispatcher = self.dispatcher;
        let mut reserved = Vec::with_capacity(group.len());
        for (topic, batch) in group.iter().zip(batches) {
            dispatcher.clock.observe(batch.now, sent);
            // A rate-limited topic is planned for its next token, not its (past) head:
            // no busy loop, and the other topics are served meanwhile.
            let next = match (batch.next_due, batch.next_token) {
                (Some(due), Some(token)) => Some(due.max(token)),
                (due, _) => due,
            };
            let pause = if telemetry::enabled() {
                self.pause_of(topic, &batch).await
            } else {
                None
            };
            self.learned.replies.push(Reply {
                topic: topic.clone(),
                paused: batch.paused,
                next_due: next,
            });
            if !batch.corrupt.is_empty() {
                dispatcher
                    .metrics
                    .corrupt_records
                    .inc_by(batch.corrupt.len() as u64);
                tracing::error!(%topic, ids = ?batch.corrupt, "scheduled ids with missing or unreadable records taken off the schedule; run `redisched check`");
            }
            let jobs = self
                .triage(topic, batch.jobs, batch.throttled > 0, pause)
                .await;
            reserved.push((topic.clone(), jobs));
        }
        reserved
    }

    /// The topic's last pause that ended, for the spans of the jobs `batch` took: a
    /// reply that finds the topic paused begins one (since the time `lua/pause.lua`
    /// wrote, read once; this reply's time if unreadable), the first that finds it
    /// running ends it.
    async fn pause_of(&mut self, topic: &Topic, batch: &Batch) -> Option<(i64, i64)> {
        if !batch.paused {
            return self.learned.pauses.before(topic, batch.now, batch.next_due);
        }
        if self.learned.pauses.is_new(topic) {
            let since = match self.dispatcher.store.paused_at(topic).await {
                Ok(since) => since,
                Err(err) => {
                    tracing::debug!(%topic, %err, "when the topic was paused is unreadable; counting from this reserve");
                    None
                }
            };
            // Later than the reply: resumed and paused again since, so the reply's time.
            let since = since.filter(|at| *at <= batch.now).unwrap_or(batch.now);
            self.learned.pauses.began(topic, since);
        }
        None
    }

    /// The jobs of `topic` to deliver: each with its ticket, unless its series cannot
    /// go on (failed with backoff) or it expired (set aside, by the server's clock as
    /// just read by the reserve).
    async fn triage(
        &self,
        topic: &Topic,
        jobs: Vec<ReservedJob>,
        throttled: bool,
        pause: Option<(i64, i64)>,
    ) -> Vec<Reserved> {
        let set_aside = &self.dispatcher.set_aside;
        let mut deliver = Vec::with_capacity(jobs.len());
        for job in jobs {
            let ticket = match Ticket::of(topic, &job) {
                Ok(ticket) => ticket,
                Err((lease, reason)) => {
                    self.settler
                        .fail_unreadable(&lease, job.attempt, &reason)
                        .await;
                    continue;
                }
            };
            let mut reserved = Reserved::new(job, ticket, throttled, pause);
            match reserved.expired(&set_aside.policies, self.dispatcher.clock.now()) {
                Some(ms) => set_aside.take(reserved, ms, self.settler),
                None => deliver.push(reserved),
            }
        }
        deliver
    }
}

/// What reserves learned that outlives the round: each reply's news of its topic, for
/// the plan's next turn (`Plan::learn`), and each topic's last pause.
#[derive(Debug, Default)]
pub struct Learned {
    pub(super) replies: Vec<Reply>,
    pauses: Pauses,
}

/// What one reserve reply said of its topic.
#[derive(Debug)]
pub(super) struct Reply {
    pub(super) topic: Topic,
    pub(super) paused: bool,
    /// Its next due time (a rate-limited topic's next token, if later).
    pub(super) next_due: Option<i64>,
}

/// Each topic's last pause, recorded only while spans are exported (for their
/// `redisched.paused_ms`); an ended one is kept while a job due during it waits.
#[derive(Debug, Default)]
struct Pauses(HashMap<Topic, Pause>);

/// A topic's pause as this loop saw it, on the Redis clock (epoch ms): from the time
/// `lua/pause.lua` wrote to the `now` of the first reserve reply that found the topic
/// running again (`None` while it lasts, when the topic gives no jobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pause {
    since: i64,
    until: Option<i64>,
}

impl Pauses {
    /// Whether a reply that found `topic` paused starts a pause not recorded yet (then
    /// read since when, for [`Pauses::began`]).
    fn is_new(&self, topic: &Topic) -> bool {
        self.0.get(topic).is_none_or(|pause| pause.until.is_some())
    }

    fn began(&mut self, topic: &Topic, since: i64) {
        let pause = Pause { since, until: None };
        self.0.insert(topic.clone(), pause);
    }

    /// A reply that found `topic` running at `now`, its earliest waiting job due at
    /// `next_due`: ends the topic's pause if one lasts, and answers its last pause
    /// (paused at, resumed at) for the jobs the reply took. Once no waiting job was due
    /// before the resume, the pause is forgotten.
    fn before(&mut self, topic: &Topic, now: i64, next_due: Option<i64>) -> Option<(i64, i64)> {
        // The usual case, no topic paused: no lookup.
        if self.0.is_empty() {
            return None;
        }
        let pause = self.0.get_mut(topic)?;
        let until = *pause.until.get_or_insert(now);
        let ended = (pause.since, until);
        if next_due.is_none_or(|due| due >= until) {
            self.0.remove(topic);
        }
        Some(ended)
    }
}

/// What settling one reserved job needs, whichever sink delivers it.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub(crate) lease: Lease,
    /// A series occurrence: released with its next occurrence.
    pub(crate) schedule: Option<Schedule>,
    /// When the job was due: a series occurrence's scheduled time plus its jitter.
    pub(crate) due_at: i64,
    /// The occurrence's scheduled time (the record's `due_at`, the series' grid).
    pub(crate) scheduled_at: i64,
    /// The series' `x-redisched-jitter` (0: none): the next occurrence's delay.
    pub(crate) jitter_ms: u64,
    pub(crate) attempt: u32,
    /// For the `dispatched` history entry (a webhook's `HTTP 200`); empty for AMQP.
    pub(crate) note: String,
    /// Not delivered: expired `expires_after` ms after its due time, and set aside to
    /// the expired exchange instead. Released all the same, logged `expired`.
    pub(crate) expired: Option<u64>,
}

impl Ticket {
    /// The ticket of a job reserved from `topic`. A series occurrence is delivered only
    /// if its next occurrence can be computed at release: a spec in another client's
    /// convention is `Err` (the job's failure), with its lease.
    ///
    /// A jittered series (`x-redisched-jitter` in its stored properties) is due at its
    /// scheduled time (the record's `due_at`) plus the occurrence's delay: that is the
    /// ticket's `due_at`. An occurrence reserved before that time was scheduled without
    /// its delay (released by a bridge of the release before jitter, or re-indexed by
    /// `check --repair` at its record's time): it is due at its scheduled time, never
    /// reported later than it was due.
    pub(crate) fn of(topic: &Topic, job: &ReservedJob) -> Result<Self, (Lease, String)> {
        let lease = Lease {
            topic: topic.clone(),
            id: job.id.clone(),
            token: job.token,
        };
        let schedule = match job.spec.as_deref().map(Schedule::from_spec) {
            None => None,
            Some(Ok(schedule)) => Some(schedule),
            Some(Err(err)) => return Err((lease, format!("unreadable schedule spec: {err}"))),
        };
        let jitter_ms = match &schedule {
            Some(_) => decode_meta(&job.meta).map_or(0, |props| jitter_of(&props)),
            None => 0,
        };
        let delay = match &schedule {
            Some(schedule) if jitter_ms > 0 => {
                schedule.occurrence_delay(topic.as_str(), &job.id, job.due_at, jitter_ms)
            }
            _ => 0,
        };
        let jittered = job.due_at.saturating_add(i64::try_from(delay).unwrap_or(0));
        Ok(Self {
            lease,
            schedule,
            due_at: if jittered <= job.reserved_at {
                jittered
            } else {
                job.due_at
            },
            scheduled_at: job.due_at,
            jitter_ms,
            attempt: job.attempt,
            note: String::new(),
            expired: None,
        })
    }

    /// This ticket, for a job set aside as expired `ms` after its due time.
    pub(crate) fn expired_after(self, ms: u64) -> Self {
        let reason = expiry::reason(ms);
        Self {
            note: reason
                .strip_prefix("expired: ")
                .unwrap_or(&reason)
                .to_owned(),
            expired: Some(ms),
            ..self
        }
    }

    pub fn topic(&self) -> &Topic {
        &self.lease.topic
    }

    pub fn id(&self) -> &str {
        &self.lease.id
    }

    /// When the job was due (a series occurrence's jittered time), server epoch ms.
    pub fn due_at(&self) -> i64 {
        self.due_at
    }

    /// Its delivery attempt, 1 for the first.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// A reserved job to deliver, with its ticket (one not expired and not failed already).
#[derive(Debug)]
pub struct Reserved {
    pub job: ReservedJob,
    pub ticket: Ticket,
    /// Its stored properties, once decoded (the expiry check may have needed them).
    props: Option<AMQPProperties>,
    /// The reserve call that took it held due jobs of its topic back (rate limit).
    throttled: bool,
    /// Its topic's last pause that ended, (paused at, resumed at) on the Redis clock;
    /// recorded only while spans are exported.
    pause: Option<(i64, i64)>,
}

impl Reserved {
    pub(crate) fn new(
        job: ReservedJob,
        ticket: Ticket,
        throttled: bool,
        pause: Option<(i64, i64)>,
    ) -> Self {
        Self {
            job,
            ticket,
            props: None,
            throttled,
            pause,
        }
    }

    /// This attempt as its delivery span describes it (`telemetry::delivery_span`).
    pub(crate) fn attempt_via<'a>(&'a self, via: Via<'a>) -> telemetry::Delivery<'a> {
        let (job, ticket) = (&self.job, &self.ticket);
        telemetry::Delivery {
            via,
            topic: ticket.lease.topic.as_str(),
            id: &job.id,
            attempt: job.attempt,
            due_at: ticket.due_at,
            scheduled_at: ticket.schedule.as_ref().map(|_| ticket.scheduled_at),
            reserved_at: job.reserved_at,
            throttled: self.throttled,
            pause: self.pause,
        }
    }

    /// The job's stored properties (content type, headers, its own URL), decoded once;
    /// unreadable ones are logged and delivered as none.
    pub fn properties(&mut self) -> &AMQPProperties {
        let (topic, job) = (&self.ticket.lease.topic, &self.job);
        self.props.get_or_insert_with(|| {
            decode_meta(&job.meta).unwrap_or_else(|err| {
                tracing::warn!(%topic, id = %job.id, %err, "job metadata unreadable; delivering without it");
                AMQPProperties::default()
            })
        })
    }

    /// How long after its due time this job expired, if it had at `now` (the server's
    /// clock): the rule is `job::expiry`'s, with `policies`' defaults. Its meta is
    /// decoded only where expiry may apply.
    pub(crate) fn expired(&mut self, policies: &Policies, now: i64) -> Option<u64> {
        if !expiry::may_expire(policies, &self.ticket.lease.topic, &self.job.meta) {
            return None;
        }
        let (topic, due_at) = (self.ticket.lease.topic.clone(), self.ticket.due_at);
        let ms = expiry::expires_after(policies, &topic, self.properties()).unwrap_or_else(|err| {
            tracing::warn!(%topic, %err, "unreadable expiry header; the job does not expire");
            0
        });
        expiry::is_expired(due_at, ms, now).then_some(ms)
    }

    /// [`Self::properties`], taken out.
    pub fn take_properties(&mut self) -> AMQPProperties {
        self.properties();
        self.props.take().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topic(name: &str) -> Topic {
        Topic::new(name).expect("a valid topic")
    }

    #[test]
    fn a_pause_ends_at_the_first_reply_that_finds_the_topic_running() {
        let mut pauses = Pauses::default();
        assert_eq!(pauses.before(&topic("a"), 500, None), None, "none recorded");
        assert!(pauses.is_new(&topic("a")));
        pauses.began(&topic("a"), 1_000);
        // Found paused again: the same pause, not read again.
        assert!(!pauses.is_new(&topic("a")));
        assert_eq!(
            pauses.before(&topic("b"), 2_000, None),
            None,
            "another topic"
        );
        // Running at 3,000 with a job due at 1,500 still waiting: ended, and kept.
        assert_eq!(
            pauses.before(&topic("a"), 3_000, Some(1_500)),
            Some((1_000, 3_000))
        );
        assert!(
            pauses.is_new(&topic("a")),
            "a reply found it paused again: a new one"
        );
        // Later replies keep its end; once nothing due before it waits, it is forgotten.
        assert_eq!(
            pauses.before(&topic("a"), 3_500, Some(3_000)),
            Some((1_000, 3_000))
        );
        assert!(pauses.0.is_empty());
        assert_eq!(pauses.before(&topic("a"), 4_000, Some(2_000)), None);
        // Paused again: the new pause replaces the old one.
        pauses.began(&topic("a"), 5_000);
        assert_eq!(
            pauses.before(&topic("a"), 6_000, None),
            Some((5_000, 6_000))
        );
        assert!(pauses.0.is_empty());
    }

    #[test]
    fn an_expired_ticket_carries_the_reason_as_its_note() {
        let ticket = Ticket {
            lease: Lease {
                topic: Topic::new("t").unwrap(),
                id: "a".into(),
                token: 3,
            },
            schedule: None,
            due_at: 1_000,
            scheduled_at: 1_000,
            jitter_ms: 0,
            attempt: 2,
            note: String::new(),
            expired: None,
        };
        let marked = ticket.expired_after(250);
        assert_eq!(marked.expired, Some(250));
        assert_eq!(
            marked.note,
            "not delivered within 250 ms after its due time"
        );
        assert_eq!((marked.due_at, marked.attempt), (1_000, 2));
    }
}

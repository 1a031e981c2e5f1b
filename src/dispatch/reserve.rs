//! The reserve, for every sink: one round trip for a group of due topics
//! (`lua/reserve.lua`, which alone decides what is due and applies rate limits), the
//! plan and the server clock corrected from its replies, and each job triaged before a
//! sink sees it: its settle ticket made (`ticket.rs`); a series occurrence whose next
//! one cannot be computed failed; an expired job set aside (`set_aside.rs`). What is
//! left goes to the sink's round, to be sent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::plan::Plan;
use super::settle::Settler;
use super::ticket::{Reserved, Ticket};
use super::Dispatcher;
use crate::job::Topic;
use crate::store::{Batch, ReservedJob, StoreError};

/// Due topics reserved from in one round trip at most.
pub const RESERVE_GROUP: usize = 64;

/// What a capped reserve left of a topic: retries held back by the cap, and whether
/// due jobs went unseen (`false`: every due first attempt was taken).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub retries: u64,
    pub unseen: bool,
}

/// What a sink's round borrows from its loop: the reserve, and where outcomes go.
#[derive(Debug)]
pub struct Core<'a> {
    pub(super) dispatcher: &'a Dispatcher,
    pub(super) plan: &'a mut Plan,
    pub(super) settler: &'a Arc<Settler>,
    pub(super) shutdown: &'a CancellationToken,
}

impl Core<'_> {
    /// Where the sink reports each job's outcome.
    pub fn settler(&self) -> &Arc<Settler> {
        self.settler
    }

    /// The bridge's shutdown: a round that waits gives up when it comes.
    pub fn shutdown(&self) -> &CancellationToken {
        self.shutdown
    }

    /// `dispatch.batch`: the most jobs of one topic a reserve takes.
    pub fn batch(&self) -> usize {
        self.dispatcher.config.dispatch.batch
    }

    /// Reserves up to `each` jobs of every topic of `group` (keep it to
    /// [`RESERVE_GROUP`]) in one round trip, corrects the plan and the clock from the
    /// replies, and returns each topic's jobs to deliver (expired ones set aside and
    /// unreadable series failed already).
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

    /// The plan and the clock corrected from `batches` (a reserve of `group` sent at
    /// `sent`), and each topic's jobs triaged.
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
            self.plan.reserved(topic, batch.paused, next);
            if !batch.corrupt.is_empty() {
                dispatcher
                    .metrics
                    .corrupt_records
                    .inc_by(batch.corrupt.len() as u64);
                tracing::error!(%topic, ids = ?batch.corrupt, "scheduled ids with missing or unreadable records taken off the schedule; run `redisched check`");
            }
            let jobs = self.triage(topic, batch.jobs, batch.throttled > 0).await;
            reserved.push((topic.clone(), jobs));
        }
        reserved
    }

    /// The jobs of `topic` to deliver: each with its ticket, unless its series cannot
    /// go on (failed with backoff) or it expired (set aside, by the server's clock as
    /// just read by the reserve).
    async fn triage(
        &self,
        topic: &Topic,
        jobs: Vec<ReservedJob>,
        throttled: bool,
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
            let mut reserved = Reserved::new(job, ticket, throttled);
            match set_aside.expired(&mut reserved, self.dispatcher.clock.now()) {
                Some(ms) => set_aside.take(reserved, ms, self.settler),
                None => deliver.push(reserved),
            }
        }
        deliver
    }
}

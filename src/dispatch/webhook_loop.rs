//! The webhook sinks' loop, one for the whole process and no broker involved: reserve
//! for each target's due topics no more jobs than it has free slots, and POST each at
//! once (`webhook_sink.rs`), so a slow or dead target holds only its own slots.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::settle::Settler;
use super::sink::{self, Route, Serves};
use super::{sleep_or_shutdown, Dispatcher, Plan, RESERVE_GROUP};
use crate::job::Topic;

impl Dispatcher {
    /// Dispatches the webhook targets' topics until `shutdown`, with no broker involved:
    /// bring the plan up to date, nap until something is due (or a slot frees), then
    /// reserve for each target's due topics what it has free slots for and POST each job
    /// at once. Runs beside the AMQP sessions, on a plan and hints of its own, so a
    /// broker outage or block does not stop webhook deliveries. On shutdown, requests in
    /// flight get `dispatch.shutdown_grace_ms`.
    pub async fn run_webhooks(&self, plan: &mut Plan, shutdown: CancellationToken) {
        let cfg = &self.config.dispatch;
        let poll = Duration::from_millis(cfg.poll_interval_ms);
        let ttr = Duration::from_millis(cfg.ttr_ms);
        // One for the loop, shared by every request's task rather than cloned into it.
        let settler = Arc::new(self.settler());
        let mut redis_backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let step = async {
                self.update_plan(plan, poll, Serves::Webhooks).await?;
                let now = self.clock.now();
                let mut due = plan.due(now);
                plan.turn = plan.turn.wrapping_add(1);
                if !due.is_empty() {
                    let start = plan.turn % due.len();
                    due.rotate_left(start);
                }
                let (hooks, full) = self.split_by_target(due);
                if hooks.is_empty() {
                    // Nothing due, or only topics of targets without a free slot: sleep
                    // until a slot frees, a hint, or the next topic that can be served.
                    self.nap(plan, poll, &full, &shutdown).await;
                    return Ok(());
                }
                self.reserve_for_webhooks(plan, hooks, ttr, &settler).await
            };
            match step.await {
                Ok(()) => redis_backoff = Duration::from_millis(100),
                Err(err) => {
                    tracing::warn!(error = %err, retry_in = ?redis_backoff, "redis unavailable; webhook dispatch waits");
                    sleep_or_shutdown(redis_backoff, &shutdown).await;
                    redis_backoff = (redis_backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        let grace = Duration::from_millis(cfg.shutdown_grace_ms);
        if !self.webhooks.drain(grace).await {
            tracing::warn!(
                ?grace,
                "webhook requests still running at the end of the grace period; those jobs stay reserved and are requeued after their time-to-run"
            );
        }
    }

    /// Groups due webhook topics by target, each target's list cut to its free slots;
    /// also returns the topics left out for want of a slot (served again once a
    /// request ends).
    fn split_by_target(&self, due: Vec<Topic>) -> (Vec<(usize, Vec<Topic>)>, HashSet<Topic>) {
        let mut hooks: Vec<(usize, Vec<Topic>)> = Vec::new();
        let mut full = HashSet::new();
        for topic in due {
            match self.webhooks.route(&topic) {
                Route::Amqp => {}
                Route::Webhook(index) => {
                    let room = self.webhooks.room(index);
                    match hooks.iter_mut().find(|(i, _)| *i == index) {
                        Some((_, topics)) if topics.len() < room => topics.push(topic),
                        None if room > 0 => hooks.push((index, vec![topic])),
                        _ => {
                            full.insert(topic);
                        }
                    }
                }
            }
        }
        (hooks, full)
    }

    /// Reserves, per target, at most its free slots' worth of jobs over its due
    /// topics, and starts POSTing each at once.
    async fn reserve_for_webhooks(
        &self,
        plan: &mut Plan,
        hooks: Vec<(usize, Vec<Topic>)>,
        ttr: Duration,
        settler: &Arc<Settler>,
    ) -> Result<(), crate::store::StoreError> {
        for (index, topics) in hooks {
            let room = self.webhooks.room(index);
            if room == 0 {
                continue;
            }
            let each = (room / topics.len()).clamp(1, self.config.dispatch.batch);
            for group in topics.chunks(RESERVE_GROUP) {
                for (topic, jobs) in self.reserve_group(plan, group, ttr, each).await? {
                    for job in jobs {
                        match sink::ticket(&topic, &job) {
                            Err((lease, reason)) => {
                                settler.fail_unreadable(&lease, job.attempt, &reason).await;
                            }
                            Ok(ticket)
                                if self.expiry.take_expired(
                                    &self.config.amqp.expired_exchange,
                                    &topic,
                                    &job,
                                    &ticket,
                                    settler,
                                ) => {}
                            Ok(ticket) => {
                                let lease = ticket.lease.clone();
                                if self.webhooks.send(index, job, ticket, settler).is_err() {
                                    // Not expected: only this loop takes slots. Due again now
                                    // (or, if Redis does not answer, once the TTR expires).
                                    if let Err(error) =
                                        self.store.retry(&lease, Duration::ZERO).await
                                    {
                                        tracing::warn!(%error, topic = %topic, "could not hand a job back; its reservation expires into a requeue");
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

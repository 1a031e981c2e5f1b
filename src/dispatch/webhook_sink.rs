//! The webhook sink: each target has its own in-flight cap (`max_in_flight`), and
//! dispatch reserves for a target's topics only as many jobs as it has free slots, so a
//! reserved job is POSTed at once (never queued towards its time-to-run), and a slow or
//! dead target holds only its own slots, never the AMQP confirm window or another
//! target's. A slot is held from the reserve to the request's answer (a failure: until
//! its retry is recorded); a delivered job's release is batched with others'.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use hyper::body::Bytes;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::task::TaskTracker;

use super::settle::{Settler, Ticket};
use super::sink::Route;
use crate::amqp::decode_meta;
use crate::config::Config;
use crate::job::Topic;
use crate::metrics::TargetMeter;
use crate::store::ReservedJob;
use crate::webhook::{Client, Outgoing};

#[derive(Debug)]
struct Target {
    /// Shared with each request's task: built once, at setup.
    client: Arc<Client>,
    slots: Arc<Semaphore>,
    /// Its metrics, taken from the registry at its first request.
    meter: OnceLock<Arc<TargetMeter>>,
}

/// Every configured target, shared by the dispatch sessions of one bridge.
#[derive(Debug)]
pub struct WebhookSinks {
    targets: Vec<Target>,
    /// Signalled whenever a request ends and frees a slot.
    room: Arc<Notify>,
    releases: Arc<Releases>,
    tasks: TaskTracker,
}

/// Delivered jobs waiting for their release, and whether a request's task is releasing
/// now. Releases go to Redis in batches: the task that finds none running releases
/// everything that has gathered (its own job first), looping until nothing is left; a
/// request that ends meanwhile only adds its job. One `release.lua` round trip per job
/// made the store the bottleneck (the AMQP sink batches its confirms the same way). A
/// job gives its slot back when its answer comes, not when its release does: a slot
/// bounds requests in flight, and the release round trip no longer idles it (jobs
/// reserved at once: `max_in_flight` plus the delivered ones of the release running).
#[derive(Debug, Default)]
struct Releases {
    pending: Mutex<(Vec<Ticket>, bool)>,
}

impl Releases {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<Ticket>, bool)> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn release(&self, settler: &Settler, done: Ticket) {
        {
            let mut pending = self.lock();
            pending.0.push(done);
            if pending.1 {
                return;
            }
            pending.1 = true;
        }
        loop {
            let batch = {
                let mut pending = self.lock();
                if pending.0.is_empty() {
                    pending.1 = false;
                    return;
                }
                std::mem::take(&mut pending.0)
            };
            settler.release(&batch).await;
        }
    }
}

impl WebhookSinks {
    /// One client per `[[targets]]` entry; `Err` names the target (a CA file that
    /// cannot be read, say).
    pub fn new(config: &Config) -> Result<Self, String> {
        let targets = config
            .targets
            .iter()
            .map(|t| {
                Ok(Target {
                    slots: Arc::new(Semaphore::new(t.max_in_flight)),
                    client: Arc::new(Client::new(t.clone())?),
                    meter: OnceLock::new(),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self {
            targets,
            room: Arc::new(Notify::new()),
            releases: Arc::default(),
            tasks: TaskTracker::new(),
        })
    }

    pub(crate) fn route(&self, topic: &Topic) -> Route {
        self.targets
            .iter()
            .position(|t| t.client.target.serves(topic.as_str()))
            .map_or(Route::Amqp, Route::Webhook)
    }

    /// Free slots of target `index` worth a reserve: none until a quarter of its
    /// `max_in_flight` is free (at least one). A busy target then gets its jobs in
    /// reserves (and releases) of a quarter of its slots rather than of the one or
    /// two that each release freed: each script call has a fixed cost in Redis, and
    /// three quarters of its slots are still working meanwhile. An idle target (the
    /// steady case below saturation) has all its slots free, so no job waits for this.
    pub(crate) fn room(&self, index: usize) -> usize {
        self.targets.get(index).map_or(0, |t| {
            let free = t.slots.available_permits();
            if free >= (t.client.target.max_in_flight / 4).max(1) {
                free
            } else {
                0
            }
        })
    }

    /// Waits until some request ends (a permit is stored if none was waiting, so a
    /// slot freed just before the wait is not missed).
    pub(crate) async fn room_freed(&self) {
        self.room.notified().await;
    }

    /// Starts POSTing a reserved job of a target with a free slot; `Err` gives the job
    /// back when there is none (the caller reserved more than [`Self::room`]).
    #[allow(clippy::result_large_err)] // the job itself comes back, on a rare path
    pub(crate) fn send(
        &self,
        index: usize,
        job: ReservedJob,
        ticket: Ticket,
        settler: &Arc<Settler>,
    ) -> Result<(), ReservedJob> {
        let Some(target) = self.targets.get(index) else {
            return Err(job);
        };
        let Ok(slot) = target.slots.clone().try_acquire_owned() else {
            return Err(job);
        };
        let meter = target
            .meter
            .get_or_init(|| settler.metrics.webhooks.meter(&target.client.target.name))
            .clone();
        let delivery = Delivery {
            client: target.client.clone(),
            meter,
            job,
            ticket,
            settler: settler.clone(),
            room: self.room.clone(),
            releases: self.releases.clone(),
        };
        self.tasks.spawn(delivery.run(slot));
        Ok(())
    }

    /// Waits up to `grace` for requests in flight (shutdown); those still running are
    /// left to their time-to-run.
    pub async fn drain(&self, grace: Duration) -> bool {
        self.tasks.close();
        let done = tokio::time::timeout(grace, self.tasks.wait()).await.is_ok();
        self.tasks.reopen();
        done
    }
}

struct Delivery {
    client: Arc<Client>,
    meter: Arc<TargetMeter>,
    job: ReservedJob,
    /// Its lease names the job's topic.
    ticket: Ticket,
    settler: Arc<Settler>,
    room: Arc<Notify>,
    releases: Arc<Releases>,
}

impl Delivery {
    async fn run(mut self, slot: OwnedSemaphorePermit) {
        let client = self.client.clone();
        let name = client.target.name.as_str();
        let meter = self.meter.clone();
        let topic = &self.ticket.lease.topic;
        let props = decode_meta(&self.job.meta).unwrap_or_else(|err| {
            tracing::warn!(topic = %topic, id = %self.job.id, %err, "job metadata unreadable; delivering without it");
            Default::default()
        });
        // Moved, not copied: the request shares these bytes.
        let body = Bytes::from(std::mem::take(&mut self.job.body));
        let outgoing = Outgoing {
            topic: topic.as_str(),
            id: &self.job.id,
            due_at: self.ticket.due_at,
            scheduled_at: self.ticket.scheduled_at,
            attempt: self.job.attempt,
            body: &body,
            props: &props,
        };
        meter.started();
        let (result, took) = client.post(&outgoing).await;
        let seconds = took.as_secs_f64();
        match result {
            Ok(delivered) => {
                let mut status = itoa::Buffer::new();
                meter.finished("2xx", status.format(delivered.status), None, seconds);
                let mut ticket = self.ticket;
                ticket.note = format!("HTTP {}", delivered.status);
                // The request is over: its slot serves the next job while this one
                // waits for its release.
                drop(slot);
                self.room.notify_one();
                self.releases.release(&self.settler, ticket).await;
                return;
            }
            Err(failure) => {
                let status = failure
                    .status
                    .map_or_else(|| failure.code.to_owned(), |s| s.to_string());
                meter.finished(failure.code, &status, Some(failure.reason.clone()), seconds);
                tracing::debug!(target = %name, topic = %topic, id = %self.job.id, reason = %failure.reason, "webhook delivery failed; retried");
                let cap = Duration::from_millis(self.settler.config.dispatch.retry_max_ms);
                // `Retry-After` says "not before": never earlier than the backoff either.
                let delay = self
                    .settler
                    .retry_delay(self.job.attempt)
                    .max(failure.retry_after.map_or(Duration::ZERO, |d| d.min(cap)));
                self.settler
                    .fail(&self.ticket.lease, delay, "webhook", &failure.reason)
                    .await;
            }
        }
        drop(slot);
        self.room.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::TargetConfig;

    fn sinks(max_in_flight: usize) -> WebhookSinks {
        let config = Config {
            targets: vec![TargetConfig {
                name: "t".into(),
                topics: vec!["t".into()],
                url: "http://127.0.0.1:9/".into(),
                max_in_flight,
                ..TargetConfig::default()
            }],
            ..Config::default()
        };
        WebhookSinks::new(&config).expect("a valid target")
    }

    #[test]
    fn a_busy_target_is_served_again_once_a_quarter_of_its_slots_is_free() {
        let sinks = sinks(8);
        assert_eq!(sinks.room(0), 8, "an idle target has every slot");
        let slots = sinks.targets[0].slots.clone();
        let mut held: Vec<_> = (0..8)
            .filter_map(|_| slots.clone().try_acquire_owned().ok())
            .collect();
        assert_eq!(sinks.room(0), 0);
        held.pop();
        assert_eq!(
            sinks.room(0),
            0,
            "one free slot of 8 is not worth a reserve"
        );
        held.pop();
        assert_eq!(sinks.room(0), 2, "a quarter is");
        assert_eq!(sinks.room(1), 0, "no such target");
    }

    #[test]
    fn a_target_of_fewer_than_four_slots_is_served_at_each_free_slot() {
        let sinks = sinks(3);
        let slots = sinks.targets[0].slots.clone();
        let mut held: Vec<_> = (0..3)
            .filter_map(|_| slots.clone().try_acquire_owned().ok())
            .collect();
        assert_eq!(sinks.room(0), 0);
        held.pop();
        assert_eq!(sinks.room(0), 1);
    }
}

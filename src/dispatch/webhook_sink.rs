//! The webhook sink: each target has its own in-flight cap (`max_in_flight`), and
//! dispatch reserves for a target's topics only as many jobs as it has free slots, so a
//! reserved job is POSTed at once (never queued towards its time-to-run), and a slow or
//! dead target holds only its own slots, never the AMQP confirm window or another
//! target's. A slot is held from the reserve to the request's answer (a failure: until
//! its retry is recorded); a delivered job's release is batched with others'.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::task::TaskTracker;

use super::settle::{Settler, Ticket};
use super::sink::Route;
use crate::config::Config;
use crate::job::meta::decode_meta;
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
    /// When a request of it last started, in µs since [`WebhookSinks::epoch`].
    last_send_us: AtomicU64,
}

/// Every configured target, shared by the dispatch sessions of one bridge.
#[derive(Debug)]
pub struct WebhookSinks {
    targets: Vec<Target>,
    /// Signalled whenever a request ends and frees a slot.
    room: Arc<Notify>,
    releases: Arc<Releases>,
    tasks: TaskTracker,
    epoch: Instant,
}

/// How long a busy target's few free slots wait for more to free before they are
/// served anyway (see [`WebhookSinks::room`]).
const LINGER: Duration = Duration::from_millis(1);

/// Free slots of a busy target of `max_in_flight` that make a reserve worth it at once:
/// a quarter, at most 16 (see [`WebhookSinks::room`]; the bench's bookkeeping floor
/// follows the same rule).
pub fn slots_worth_a_reserve(max_in_flight: usize) -> usize {
    (max_in_flight / 4).clamp(1, 16)
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
                    last_send_us: AtomicU64::new(0),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self {
            targets,
            room: Arc::new(Notify::new()),
            releases: Arc::default(),
            tasks: TaskTracker::new(),
            epoch: Instant::now(),
        })
    }

    pub(crate) fn route(&self, topic: &Topic) -> Route {
        self.targets
            .iter()
            .position(|t| t.client.target.serves(topic.as_str()))
            .map_or(Route::Amqp, Route::Webhook)
    }

    /// Free slots of target `index` worth a reserve. A busy target's first free slots
    /// wait, up to [`LINGER`] after its last request started, for a quarter of its
    /// `max_in_flight` (at most 16) to be free: a fast target then gets its jobs in
    /// reserves (and releases) of a dozen or more rather than of the one or two each
    /// answer freed (each script call has a fixed cost in Redis), and a slow one loses
    /// at most that millisecond per slot. An idle target has all its slots free.
    pub(crate) fn room(&self, index: usize) -> usize {
        let Some(t) = self.targets.get(index) else {
            return 0;
        };
        let free = t.slots.available_permits();
        if free >= Self::worth(t) || (free > 0 && self.linger_end(t) <= Instant::now()) {
            free
        } else {
            0
        }
    }

    fn worth(t: &Target) -> usize {
        slots_worth_a_reserve(t.client.target.max_in_flight)
    }

    fn linger_end(&self, t: &Target) -> Instant {
        self.epoch + Duration::from_micros(t.last_send_us.load(Ordering::Relaxed)) + LINGER
    }

    /// When some target's free slots, too few to be worth a reserve yet, will be
    /// served anyway: the dispatch loop's nap ends then at the latest.
    pub(crate) fn lingering_until(&self) -> Option<Instant> {
        self.targets
            .iter()
            .filter(|t| (1..Self::worth(t)).contains(&t.slots.available_permits()))
            .map(|t| self.linger_end(t))
            // Once past, `room` serves them (if their topics have jobs due): no wake.
            .filter(|at| *at > Instant::now())
            .min()
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
        let since = u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
        target.last_send_us.store(since, Ordering::Relaxed);
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
        let delivered = match result {
            Ok(delivered) => {
                let mut status = itoa::Buffer::new();
                meter.finished("2xx", status.format(delivered.status), None, seconds);
                let mut ticket = self.ticket;
                ticket.note = format!("HTTP {}", delivered.status);
                Some(ticket)
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
                if failure.is_refusal() {
                    self.settler.park(&self.ticket.lease, &failure.reason).await;
                } else {
                    self.settler
                        .fail(&self.ticket.lease, delay, "webhook", &failure.reason)
                        .await;
                }
                None
            }
        };
        // The request is over (a failure's retry recorded): its slot serves the next
        // job, while a delivered one waits for its release.
        drop(slot);
        self.room.notify_one();
        if let Some(ticket) = delivered {
            self.releases.release(&self.settler, ticket).await;
        }
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

    /// As if target 0 had just started a request (its linger ends long after the test).
    fn just_sent(sinks: &WebhookSinks) {
        sinks.targets[0]
            .last_send_us
            .store(3_600_000_000, Ordering::Relaxed);
    }

    #[test]
    fn a_busy_target_is_served_again_once_a_quarter_of_its_slots_is_free() {
        let sinks = sinks(8);
        assert_eq!(sinks.room(0), 8, "an idle target has every slot");
        let slots = sinks.targets[0].slots.clone();
        let mut held: Vec<_> = (0..8)
            .filter_map(|_| slots.clone().try_acquire_owned().ok())
            .collect();
        just_sent(&sinks);
        assert_eq!(sinks.room(0), 0);
        assert_eq!(
            sinks.lingering_until(),
            None,
            "no slot free: nothing to wait for"
        );
        held.pop();
        assert_eq!(sinks.room(0), 0, "one free slot of 8 waits for another");
        assert!(
            sinks.lingering_until().is_some(),
            "the nap ends with the linger"
        );
        held.pop();
        assert_eq!(sinks.room(0), 2, "a quarter is served at once");
        assert_eq!(sinks.room(1), 0, "no such target");
    }

    #[test]
    fn a_few_free_slots_are_served_once_the_linger_is_over() {
        let sinks = sinks(64);
        let slots = sinks.targets[0].slots.clone();
        let mut held: Vec<_> = (0..64)
            .filter_map(|_| slots.clone().try_acquire_owned().ok())
            .collect();
        held.truncate(60);
        // The last request started at the epoch: its linger (1 ms) is over by now.
        std::thread::sleep(LINGER * 2);
        assert_eq!(sinks.room(0), 4, "a slow target does not keep slots idle");
        assert_eq!(sinks.lingering_until(), None);
        just_sent(&sinks);
        assert_eq!(sinks.room(0), 0, "while lingering, 4 of 64 wait for 16");
    }

    #[test]
    fn a_large_target_waits_for_16_free_slots_at_most() {
        let sinks = sinks(10_000);
        let slots = sinks.targets[0].slots.clone();
        let _held: Vec<_> = (0..9_984)
            .filter_map(|_| slots.clone().try_acquire_owned().ok())
            .collect();
        just_sent(&sinks);
        assert_eq!(sinks.room(0), 16);
    }

    #[test]
    fn a_target_of_fewer_than_four_slots_is_served_at_each_free_slot() {
        let sinks = sinks(3);
        let slots = sinks.targets[0].slots.clone();
        let mut held: Vec<_> = (0..3)
            .filter_map(|_| slots.clone().try_acquire_owned().ok())
            .collect();
        just_sent(&sinks);
        assert_eq!(sinks.room(0), 0);
        held.pop();
        assert_eq!(sinks.room(0), 1);
    }
}

//! The webhook sink: `[[targets]]`, each with its own in-flight cap (`max_in_flight`).
//! Its round reserves for a target's due topics only as many jobs as it has free
//! slots, so a reserved job is POSTed at once (never queued towards its time-to-run),
//! and a slow or dead target holds only its own slots, never another target's. A slot
//! is held from the reserve to the request's answer (a failure: until its retry is
//! recorded); a delivered job's release is batched with others'. Its loop runs for the
//! whole process and needs no broker.
//!
//! By role: here the targets, their slots and the round (which target each due topic
//! goes to, the free slots; then each job reserved sent); `gate.rs` the round's reserve,
//! what a target may take now: its breaker's allow (a held target's topics are not
//! reserved at all; a half-open one gets its one probe job) and its retry lane's cap
//! (retries hold at most `retry_share` of the slots, one while first attempts back up;
//! first attempts may use every slot); `delivery.rs` one request's task (prepare: the
//! request a job becomes, and its Standard Webhooks signature; call; handle; and what
//! its end tells the gate) and the batched releases; `client.rs` a target's HTTP
//! client and what an answer means, with `resolve.rs` the address guard under the
//! client of jobs' own URLs.

mod client;
mod delivery;
mod gate;
mod resolve;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::sync::mpsc::{self, UnboundedSender};
use tokio::sync::{Notify, Semaphore};
use tokio_util::task::TaskTracker;

use client::Client;
pub use delivery::FORWARDED_PREFIX;
use delivery::{Delivery, Ended, Releases, Report};
use gate::{Gates, Handout};

use super::settle::Settler;
use super::sink::{Round, RoundError, Sink};
use super::Core;
use crate::config::Config;
use crate::events::EventSender;
use crate::job::Topic;
use crate::metrics::TargetMeter;

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

/// Every configured target.
#[derive(Debug)]
pub struct WebhookSinks {
    targets: Vec<Target>,
    /// Signalled whenever a request ends and frees a slot.
    room: Arc<Notify>,
    releases: Arc<Releases>,
    tasks: TaskTracker,
    epoch: Instant,
    /// What each target may take now (`gate.rs`).
    gates: Arc<Gates>,
    /// Where each request's task tells its gate it ended, and what it wakes then.
    ended: UnboundedSender<Ended>,
    wake: Arc<Notify>,
}

/// How long a busy target's few free slots wait for more to free before they are
/// served anyway (see [`WebhookSinks::room`]).
const LINGER: Duration = Duration::from_millis(1);

/// Free slots of a busy target of `max_in_flight` that make a reserve worth it at once:
/// a quarter, at most 16 (see `WebhookSinks::room`; the bench's bookkeeping floor
/// follows the same rule).
pub fn slots_worth_a_reserve(max_in_flight: usize) -> usize {
    (max_in_flight / 4).clamp(1, 16)
}

impl WebhookSinks {
    /// One client per `[[targets]]` entry; `Err` names the target (a CA file that
    /// cannot be read, say). `events`: where the targets' state changes are published.
    pub fn new(config: &Config, events: Option<EventSender>) -> Result<Self, String> {
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
        let (room, wake) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (ended, ended_rx) = mpsc::unbounded_channel();
        let gates = Gates::new(
            &config.targets,
            room.clone(),
            wake.clone(),
            ended_rx,
            events,
        );
        Ok(Self {
            targets,
            gates: Arc::new(gates),
            ended,
            wake,
            room,
            releases: Arc::default(),
            tasks: TaskTracker::new(),
            epoch: Instant::now(),
        })
    }

    /// The target that serves `topic`: the first whose patterns match.
    fn target_of(&self, topic: &Topic) -> Option<usize> {
        self.targets
            .iter()
            .position(|t| t.client.target.serves(topic.as_str()))
    }

    /// Free slots of target `index` worth a reserve. A busy target's first free slots
    /// wait, up to [`LINGER`] after its last request started, for a quarter of its
    /// `max_in_flight` (at most 16) to be free: a fast target then gets its jobs in
    /// reserves (and releases) of a dozen or more rather than of the one or two each
    /// answer freed (each script call has a fixed cost in Redis), and a slow one loses
    /// at most that millisecond per slot. An idle target has all its slots free.
    fn room(&self, index: usize) -> usize {
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

    /// Starts POSTing a reserved job in a task of its own, under one of its target's
    /// slots. Not expected: no free slot (only this loop takes slots, and it reserves
    /// no more than [`Self::room`]); the job is then handed back, due again.
    async fn send(&self, handout: Handout, settler: &Arc<Settler>) {
        let Handout { reserved, end } = handout;
        let index = end.index;
        let report = Report::new(end, self.ended.clone(), self.wake.clone());
        let slot = self.targets.get(index).and_then(|target| {
            let slot = target.slots.clone().try_acquire_owned().ok()?;
            Some((target, slot))
        });
        let Some((target, slot)) = slot else {
            settler.hand_back(&reserved.ticket.lease).await;
            return;
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
            reserved,
            settler: settler.clone(),
            room: self.room.clone(),
            releases: self.releases.clone(),
            report,
        };
        self.tasks.spawn(delivery.run(slot));
    }
}

impl Sink for WebhookSinks {
    fn name(&self) -> &str {
        "webhook dispatch"
    }

    fn serves(&self, topic: &Topic) -> bool {
        self.target_of(topic).is_some()
    }

    /// Reserves, per target, at most its free slots' worth of jobs over its due
    /// topics, and starts POSTing each at once.
    fn round<'a>(
        &'a self,
        due: Vec<Topic>,
        core: &'a mut Core<'_>,
    ) -> BoxFuture<'a, Result<Round, RoundError>> {
        Box::pin(async move {
            let due = due
                .into_iter()
                .filter_map(|topic| Some((self.target_of(&topic)?, topic)))
                .collect();
            let rooms: Vec<usize> = (0..self.targets.len()).map(|i| self.room(i)).collect();
            let taken = self.gates.reserve(due, &rooms, core).await?;
            if !taken.served {
                // Nothing due, or only topics of targets without a free slot: nap
                // until a slot frees, a hint, or the next topic that can be served.
                return Ok(Round::Idle(taken.waiting));
            }
            let settler = core.settler();
            for handout in taken.jobs {
                self.send(handout, settler).await;
            }
            Ok(Round::Served)
        })
    }

    /// Resolves when some request ends (a permit is stored if none was waiting, so a
    /// slot freed just before the wait is not missed).
    fn room_freed(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.room.notified())
    }

    /// When some target's free slots, too few to be worth a reserve yet, will be
    /// served anyway.
    fn lingering_until(&self) -> Option<Instant> {
        self.targets
            .iter()
            .filter(|t| (1..Self::worth(t)).contains(&t.slots.available_permits()))
            .map(|t| self.linger_end(t))
            // Once past, `room` serves them (if their topics have jobs due): no wake.
            .filter(|at| *at > Instant::now())
            .min()
    }

    /// Waits up to `grace` for requests in flight; those still running are left to
    /// their time-to-run.
    fn drain(&self, grace: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.tasks.close();
            let done = tokio::time::timeout(grace, self.tasks.wait()).await.is_ok();
            self.tasks.reopen();
            if !done {
                tracing::warn!(
                    ?grace,
                    "webhook requests still running at the end of the grace period; those jobs stay reserved and are requeued after their time-to-run"
                );
            }
        })
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
        WebhookSinks::new(&config, None).expect("a valid target")
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

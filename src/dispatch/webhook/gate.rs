//! The round's reserve for the targets ([`Gates::reserve`]): for each target as much
//! as its breaker allows (its free slots, one probe job, or nothing) and, of retries
//! (attempt > 1), no more than its retry lane's cap ([`Lanes::cap`]); reserved, and
//! handed back to the round as [`Handout`]s to send. A request's task tells its gate
//! when it ends, in an `Ended` message (its outcome, the end of its retry) that the
//! gate takes in at the next round or sync ([`Gates::absorb`]): the gate's state
//! changes only here, and a job's path enters this file once.
//!
//! **The breaker.** Each target's health as this bridge sees it, kept in step with the
//! breaker every bridge shares in Redis (`Store::target_health`, policy in
//! `crate::targets::health`). A closed target is served as usual; an open or disabled
//! one not at all (its jobs stay scheduled and spend no attempt); a half-open one for
//! exactly one job, the probe, once this bridge's sync claimed it in the script (so one
//! probe at a time across all bridges). A request to the target's own URL reports its
//! outcome; outcomes are counted here ([`record`]) and sent in one `sync` call per
//! target by [`Gates::run`]'s task about once a second, at once when a failure, a
//! probe's outcome or a 410 is pending (the round syncs a target with pending failures
//! itself before reserving for it, so the breaker opens within `min_requests`), every
//! 100 ms while the target is held. A success while closed costs no round trip. The
//! changes a script call took are announced here, once: logged, counted
//! (`redisched_webhook_target_transitions_total`), and handed to the events publisher
//! (`crate::events`); the state gauge follows every sync.
//!
//! **The retry lane.** A target's retries hold at most `retry_share` of its
//! `max_in_flight` slots ([`Lanes`]), and only one while first attempts back up; first
//! attempts may use every slot. So a retry storm against a flaky endpoint never takes
//! the slots fresh deliveries need: first attempts due behind it find `1 - retry_share`
//! of the slots free at once, and every slot a retry frees while they wait. A retry
//! cannot be recalled once sent, so a retry allowed into an idle slot would hold it,
//! when first attempts come, for up to the target's `timeout_ms`; hence the share even
//! while no first attempt waits. The price: a backlog of retries alone drains through
//! its share (`retry_share = 1` lets retries use every slot, and turns lanes off).
//! Retries always keep one slot, so a job's retry is never held forever. First attempts
//! *back up* when a reserve of the target's topic came back full (as many jobs as
//! asked) with first attempts in it: more may be due behind them. That lasts until a
//! round that reserved from every due topic of the target ([`Lanes::saw`]) found none
//! so.
//!
//! Why the lane has this shape. Which due job is a retry only the job's record knows,
//! and `lua/reserve.lua` takes earliest first, so the cap is applied where the records
//! are read: the round passes `lua/reserve.lua` a `retry_cap` (the retry slots left: the
//! share minus the retries in flight, spread over the target's due topics by
//! [`split`]), and the script skips the retries past it to reach first attempts behind
//! them (a bounded scan: `limit` + 1000 due jobs at most). A topic whose capped reserve
//! took nothing but held retries waits ([`Lanes::block`]) until a retry of the target
//! ends, rather than being scanned again each round. The count of retries in flight is
//! per bridge, like `max_in_flight`: a retry counts from its hand-out until its
//! request's `Ended` is taken in (sent as its slot frees, or as its task unwinds). A target of `retry_share = 1` (or whose retry slots left cover its free slots)
//! is reserved without a cap, the same call as before lanes.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::client::Outcome;
use super::delivery::Ended;
use crate::dispatch::reserve::{Reserved, RESERVE_GROUP};
use crate::dispatch::sink::RoundError;
use crate::dispatch::Core;
use crate::events::EventSender;
use crate::job::Topic;
use crate::metrics::Metrics;
use crate::store::{HealthOp, Store, TargetHealth};
use crate::targets::health::{Change, State};
use crate::targets::{BreakerConfig, TargetConfig};

// The breaker: all, the probe, or nothing.

/// A closed target's sync interval (nothing pending).
const SYNC_CLOSED: Duration = Duration::from_secs(1);
/// A held target's: how soon an enable, or the end of `open_ms`, is seen.
const SYNC_HELD: Duration = Duration::from_millis(100);
/// A probe's claim lasts the request's timeout and this much more.
const PROBE_SLACK_MS: u64 = 5_000;

/// What the round may reserve for a target now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Allow {
    All,
    /// The half-open probe: one job.
    Probe,
    Nothing,
}

#[derive(Debug)]
struct Local {
    state: State,
    /// This bridge holds the half-open probe's claim and has not sent it yet.
    claimed: bool,
    successes: u64,
    failures: u64,
    last_failure: String,
    /// Probe outcomes and 410s, sent in order at the next sync.
    ops: Vec<HealthOp>,
    last_sync: Option<Instant>,
    /// Failures or outcomes are on their way to Redis: nothing more is sent until
    /// the answer says whether they changed the state.
    deciding: bool,
}

/// One target's gate: its breaker, as this bridge holds it, and its retry lane.
#[derive(Debug)]
struct Gate {
    name: String,
    breaker: BreakerConfig,
    lease_ms: u64,
    local: Mutex<Local>,
    lanes: Lanes,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every target's gate, by the sink's target index.
#[derive(Debug)]
pub(super) struct Gates {
    gates: Vec<Gate>,
    /// What ended requests tell (`delivery.rs`), taken in by [`Gates::absorb`].
    ended: Mutex<UnboundedReceiver<Ended>>,
    /// Wakes the sync task (an outcome to send; a request's task signals it).
    wake: Arc<Notify>,
    /// The dispatch loop's: signalled when a held target may be served again.
    room: Arc<Notify>,
    events: Option<EventSender>,
    started: AtomicBool,
}

/// What the round took for the targets: each job to send with what its request's
/// task tells when it ends, and the due topics left waiting (for a slot, the breaker or
/// the retry lane).
#[derive(Debug, Default)]
pub(super) struct Taken {
    pub(super) jobs: Vec<Handout>,
    pub(super) waiting: HashSet<Topic>,
    /// Some target could be served (else the loop naps until room frees).
    pub(super) served: bool,
}

/// A reserved job, with the [`Ended`] its request's task sends back when it ends (its
/// target, whether it is the probe, whether the lane counted it as a retry in flight).
#[derive(Debug)]
pub(super) struct Handout {
    pub(super) reserved: Reserved,
    pub(super) end: Ended,
}

/// The round's due topics by target, each target's list cut to its room.
#[derive(Debug, Default)]
struct Split {
    hooks: Vec<(usize, Vec<Topic>)>,
    full: HashSet<Topic>,
    /// Targets with a due topic left out for want of a slot.
    crowded: HashSet<usize>,
}

impl Gates {
    /// `room`: the round's, signalled when a held target may be served again; `wake`
    /// and `ended`: what each request's task signals and sends when it ends.
    pub(super) fn new(
        targets: &[TargetConfig],
        room: Arc<Notify>,
        wake: Arc<Notify>,
        ended: UnboundedReceiver<Ended>,
        events: Option<EventSender>,
    ) -> Self {
        let gates = targets
            .iter()
            .map(|t| Gate {
                name: t.name.clone(),
                breaker: t.breaker,
                lease_ms: t.timeout_ms + PROBE_SLACK_MS,
                local: Mutex::new(Local {
                    state: State::Closed,
                    claimed: false,
                    successes: 0,
                    failures: 0,
                    last_failure: String::new(),
                    ops: Vec::new(),
                    last_sync: None,
                    deciding: false,
                }),
                lanes: Lanes::new(t.max_in_flight, t.retry_share),
            })
            .collect();
        Self {
            gates,
            ended: Mutex::new(ended),
            wake,
            room,
            events,
            started: AtomicBool::new(false),
        }
    }

    /// What the round may reserve for target `index`.
    fn allow(&self, index: usize) -> Allow {
        let Some(gate) = self.gates.get(index) else {
            return Allow::Nothing;
        };
        let local = gate.lock();
        if local.deciding {
            return Allow::Nothing;
        }
        match local.state {
            // Not yet synced: served as closed (the first sync follows at once).
            State::Closed => Allow::All,
            State::HalfOpen if local.claimed => Allow::Probe,
            _ => Allow::Nothing,
        }
    }

    /// The probe's job was reserved and is being sent: no second one.
    fn probe_sent(&self, index: usize) {
        if let Some(gate) = self.gates.get(index) {
            gate.lock().claimed = false;
        }
    }

    /// Takes in what the requests that ended since told: each one's outcome for its
    /// target's breaker, each retry's end for its lane.
    fn absorb(&self) {
        let mut ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        while let Ok(end) = ended.try_recv() {
            let Some(gate) = self.gates.get(end.index) else {
                continue;
            };
            if end.retry {
                gate.lanes.end();
            }
            if let Some(outcome) = end.outcome {
                record(&mut gate.lock(), end.probe, outcome);
            }
        }
    }

    /// Whether target `index` has failures or other outcomes not yet sent.
    fn pending(&self, index: usize) -> bool {
        self.gates.get(index).is_some_and(|g| {
            let local = g.lock();
            local.failures > 0 || !local.ops.is_empty()
        })
    }

    /// Starts the sync task once (at the first round: it needs the store).
    fn start(
        self: &Arc<Self>,
        store: &Store,
        metrics: &Arc<Metrics>,
        shutdown: &CancellationToken,
    ) {
        if self.started.swap(true, Ordering::Relaxed) {
            return;
        }
        let (health, store, metrics, shutdown) = (
            self.clone(),
            store.clone(),
            metrics.clone(),
            shutdown.clone(),
        );
        tokio::spawn(async move { health.run(store, metrics, shutdown).await });
    }

    /// Syncs every target when its interval is over or something is pending, until
    /// shutdown.
    async fn run(
        self: Arc<Self>,
        store: Store,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) {
        loop {
            self.absorb();
            for index in 0..self.gates.len() {
                if self.due(index) {
                    self.sync(index, &store, &metrics).await;
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(SYNC_HELD) => {}
            }
        }
    }

    fn due(&self, index: usize) -> bool {
        let Some(gate) = self.gates.get(index) else {
            return false;
        };
        let local = gate.lock();
        let every = if local.state == State::Closed {
            SYNC_CLOSED
        } else {
            SYNC_HELD
        };
        local.failures > 0
            || !local.ops.is_empty()
            || local.last_sync.is_none_or(|at| at.elapsed() >= every)
    }

    /// Sends target `index`'s pending outcomes (and asks for the probe if it is held),
    /// then takes the answer: its state, and the changes to announce.
    async fn sync(&self, index: usize, store: &Store, metrics: &Metrics) {
        let Some(gate) = self.gates.get(index) else {
            return;
        };
        let (mut ops, sync) = {
            let mut local = gate.lock();
            let ops = std::mem::take(&mut local.ops);
            let deciding = local.failures > 0 || !ops.is_empty();
            let reason = if local.failures > 0 {
                format!("last failure: {}", local.last_failure)
            } else {
                String::new()
            };
            let sync = HealthOp::Sync {
                successes: std::mem::take(&mut local.successes),
                failures: std::mem::take(&mut local.failures),
                lease_ms: if local.claimed { 0 } else { gate.lease_ms },
                reason,
            };
            local.last_sync = Some(Instant::now());
            local.deciding = deciding;
            (ops, sync)
        };
        ops.push(sync);
        for op in ops {
            match store
                .target_health(&gate.name, &gate.breaker, op.clone())
                .await
            {
                Ok(answer) => self.take_answer(gate, answer, metrics),
                Err(err) => {
                    tracing::warn!(target = %gate.name, error = %err, "cannot sync the target's health with Redis; retried");
                    // Counts go back, to be sent with the next sync.
                    let mut local = gate.lock();
                    local.deciding = false;
                    match op {
                        HealthOp::Sync {
                            successes,
                            failures,
                            ..
                        } => {
                            local.successes += successes;
                            local.failures += failures;
                        }
                        other => local.ops.push(other),
                    }
                    return;
                }
            }
        }
    }

    fn take_answer(&self, gate: &Gate, answer: TargetHealth, metrics: &Metrics) {
        let names = State::ALL.map(State::as_str);
        metrics
            .webhooks
            .set_target_state(&gate.name, answer.state.as_str(), &names);
        for change in &answer.changes {
            announce(change, metrics, self.events.as_ref());
        }
        let mut local = gate.lock();
        let was_held = (local.state != State::Closed && !local.claimed) || local.deciding;
        local.deciding = false;
        local.state = answer.state;
        if answer.claimed {
            local.claimed = true;
        }
        if answer.state != State::HalfOpen {
            local.claimed = false;
        }
        let may_send = local.state == State::Closed || local.claimed;
        drop(local);
        if was_held && may_send {
            self.room.notify_one();
        }
    }
}

// The round's reserve: what each target may take now, taken.

impl Gates {
    /// Reserves for the round's `due` topics (each with its target's index) what each
    /// target may take now: its breaker's allow and its retry lane's cap within its
    /// free slots (`rooms`, by index). First takes in what ended requests told, and
    /// syncs a target with failures not yet counted in Redis (they may open its
    /// breaker) before reserving for it.
    pub(super) async fn reserve(
        self: &Arc<Self>,
        due: Vec<(usize, Topic)>,
        rooms: &[usize],
        core: &mut Core<'_>,
    ) -> Result<Taken, RoundError> {
        let settler = core.settler().clone();
        self.start(&settler.store, &settler.metrics, core.shutdown());
        self.absorb();
        for index in 0..self.gates.len() {
            if self.pending(index) {
                self.sync(index, &settler.store, &settler.metrics).await;
            }
        }
        let room = |index: usize| rooms.get(index).copied().unwrap_or(0);
        let Split {
            hooks,
            full,
            crowded,
        } = self.split(due, room);
        let mut taken = Taken {
            served: !hooks.is_empty(),
            waiting: full,
            jobs: Vec::new(),
        };
        for (index, topics) in hooks {
            match self.allow(index) {
                Allow::All if room(index) > 0 => {
                    let every_topic = !crowded.contains(&index);
                    let jobs = self.serve(index, &topics, room(index), every_topic, core);
                    taken.jobs.extend(jobs.await?);
                }
                Allow::Probe if room(index) > 0 => {
                    taken.jobs.extend(self.probe(index, &topics, core).await?);
                }
                _ => {}
            }
        }
        Ok(taken)
    }

    /// Groups due topics by target, each target's list cut to its room (as its breaker
    /// allows); also returns the topics left out for want of a slot (served again once
    /// a request ends) or held by the retry lane (once a retry ends).
    fn split(&self, due: Vec<(usize, Topic)>, room: impl Fn(usize) -> usize) -> Split {
        let mut split = Split::default();
        for (index, topic) in due {
            let Some(gate) = self.gates.get(index) else {
                continue;
            };
            if gate.lanes.blocked(&topic) {
                split.full.insert(topic);
                continue;
            }
            let room = match self.allow(index) {
                Allow::All => room(index),
                Allow::Probe => room(index).min(1),
                Allow::Nothing => 0,
            };
            match split.hooks.iter_mut().find(|(i, _)| *i == index) {
                Some((_, topics)) if topics.len() < room => topics.push(topic),
                None if room > 0 => split.hooks.push((index, vec![topic])),
                _ => {
                    split.crowded.insert(index);
                    split.full.insert(topic);
                }
            }
        }
        split
    }

    /// Reserves for target `index`'s due `topics` at most `room` jobs, retries
    /// (attempt > 1) at most the target's retry slots left: the script skips the
    /// retries past that cap to reach the first attempts behind them. A topic that gave
    /// nothing but held retries waits until a retry of the target ends rather than
    /// being scanned again each round. What the reserves saw tells the lane whether
    /// first attempts back up (`every_topic`: no due topic of the target was left out
    /// of this round).
    async fn serve(
        &self,
        index: usize,
        topics: &[Topic],
        room: usize,
        every_topic: bool,
        core: &mut Core<'_>,
    ) -> Result<Vec<Handout>, RoundError> {
        let Some(lanes) = self.gates.get(index).map(|g| &g.lanes) else {
            return Ok(Vec::new());
        };
        let each = (room / topics.len().max(1)).clamp(1, core.batch());
        let mut handouts = Vec::new();
        let mut backed_up = false;
        let Some(cap) = lanes.cap(room) else {
            for group in topics.chunks(RESERVE_GROUP) {
                for (_, jobs) in core.reserve(group, each).await? {
                    backed_up |= full_of_firsts(&jobs, each);
                    handouts.extend(
                        jobs.into_iter()
                            .map(|job| hand_out(lanes, index, job, false)),
                    );
                }
            }
            lanes.saw(backed_up, every_topic);
            return Ok(handouts);
        };
        let topics = lanes.retries_first(topics);
        let caps = split(cap, topics.len());
        for (group, caps) in topics.chunks(RESERVE_GROUP).zip(caps.chunks(RESERVE_GROUP)) {
            let ended = lanes.ended();
            let mut waiting = Vec::new();
            for (topic, jobs, held) in core.reserve_capped(group, each, caps).await? {
                let met = held.retries > 0 || jobs.iter().any(|r| r.job.attempt > 1);
                lanes.met_retries(&topic, met);
                if held.retries > 0 && jobs.is_empty() {
                    waiting.push(topic);
                }
                backed_up |= full_of_firsts(&jobs, each);
                handouts.extend(
                    jobs.into_iter()
                        .map(|job| hand_out(lanes, index, job, false)),
                );
            }
            // After the hand-out: a retry just counted is one that will end.
            for topic in waiting {
                lanes.block(topic, ended);
            }
        }
        lanes.saw(backed_up, every_topic);
        Ok(handouts)
    }

    /// Reserves the half-open target's one probe job (the first due topic that has
    /// one).
    async fn probe(
        &self,
        index: usize,
        topics: &[Topic],
        core: &mut Core<'_>,
    ) -> Result<Option<Handout>, RoundError> {
        let Some(gate) = self.gates.get(index) else {
            return Ok(None);
        };
        for topic in topics {
            let reserved = core.reserve(std::slice::from_ref(topic), 1).await?;
            if let Some(job) = reserved.into_iter().flat_map(|(_, jobs)| jobs).next() {
                self.probe_sent(index);
                return Ok(Some(hand_out(&gate.lanes, index, job, true)));
            }
        }
        Ok(None)
    }
}

/// `reserved`, a job of target `index`, counted in flight by `lanes` if a retry.
fn hand_out(lanes: &Lanes, index: usize, reserved: Reserved, probe: bool) -> Handout {
    let end = Ended {
        index,
        probe,
        retry: lanes.started(reserved.job.attempt),
        outcome: None,
    };
    Handout { reserved, end }
}

/// A topic's reserve came back full (`each` jobs) with first attempts in it: more may
/// be due behind them.
fn full_of_firsts(jobs: &[Reserved], each: usize) -> bool {
    jobs.len() >= each && jobs.iter().any(|r| r.job.attempt <= 1)
}

/// One request's outcome in its target's breaker: a success while closed is only
/// counted; failures, probe outcomes and 410s are sent at the next sync.
fn record(local: &mut Local, probe: bool, outcome: Outcome) {
    match (outcome, probe) {
        (Outcome::Gone(reason), _) => local.ops.push(HealthOp::Gone { reason }),
        (Outcome::Ok, true) => local.ops.push(HealthOp::Probe {
            ok: true,
            reason: String::new(),
        }),
        (Outcome::Failed(reason), true) => local.ops.push(HealthOp::Probe {
            ok: false,
            reason: format!("the probe request failed: {reason}"),
        }),
        (Outcome::Ok, false) => local.successes += 1,
        (Outcome::Failed(reason), false) => {
            local.failures += 1;
            local.last_failure = reason;
        }
    }
}

/// Logs, counts and publishes one change this bridge took.
fn announce(change: &Change, metrics: &Metrics, events: Option<&EventSender>) {
    metrics
        .webhooks
        .target_transition(&change.target, &change.to);
    match change.to.as_str() {
        "closed" | "enabled" | "half_open" => {
            tracing::info!(target = %change.target, state = %change.to, reason = %change.reason, at = %change.at, "webhook target state changed");
        }
        _ => {
            tracing::warn!(target = %change.target, state = %change.to, reason = %change.reason, at = %change.at, "webhook target state changed: its jobs are held");
        }
    }
    if let Some(events) = events {
        if events.try_send(change.clone()).is_err() {
            tracing::warn!(target = %change.target, state = %change.to, "events queue full or closed; event not published");
        }
    }
}

// The retry lane: its cap, and the topics it holds back.

/// One target's retry lane.
#[derive(Debug)]
pub(super) struct Lanes {
    /// `retry_share` × `max_in_flight`, rounded down, at least one: the most slots
    /// retries hold.
    share: usize,
    max_in_flight: usize,
    /// Retries in flight (counted when handed out, until their [`Ended`] is taken in).
    in_flight: AtomicUsize,
    /// Retries ended so far.
    ended: AtomicU64,
    /// Topics whose capped reserve held retries and took nothing, with the count of
    /// retries ended then: skipped until another retry ends.
    blocked: Mutex<HashMap<Topic, u64>>,
    /// Topics whose last capped reserve met retries: first in line for the cap.
    with_retries: Mutex<HashSet<Topic>>,
    /// First attempts back up (see the module's doc): retries get one slot.
    backed_up: AtomicBool,
}

/// The retry slots of a target: `retry_share` of `max_in_flight`, rounded down, but at
/// least one (a retry must always be able to go).
pub(super) fn share_slots(max_in_flight: usize, retry_share: f64) -> usize {
    // Both bounded (share 0..=1, validated), so the product fits and is not negative.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let slots = (max_in_flight as f64 * retry_share.clamp(0.0, 1.0)).floor() as usize;
    slots.max(1).min(max_in_flight)
}

/// Spreads `cap` retries over `n` topics: each gets `cap / n`, the first `cap % n` one
/// more (the round starts with a different topic each time, so none is favoured).
pub(super) fn split(cap: usize, n: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    (0..n).map(|i| cap / n + usize::from(i < cap % n)).collect()
}

impl Lanes {
    pub(super) fn new(max_in_flight: usize, retry_share: f64) -> Self {
        Self {
            share: share_slots(max_in_flight, retry_share),
            max_in_flight,
            in_flight: AtomicUsize::new(0),
            ended: AtomicU64::new(0),
            blocked: Mutex::default(),
            with_retries: Mutex::default(),
            backed_up: AtomicBool::new(false),
        }
    }

    /// Retries of this target in flight now (this bridge).
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The retries a reserve for `room` free slots may take, or `None` when that cap
    /// could not bind (it covers the room): reserve as usual. Their share of the
    /// slots, or one slot while first attempts back up, less the retries in flight.
    pub(super) fn cap(&self, room: usize) -> Option<usize> {
        let share = if self.backed_up() && !self.off() {
            1
        } else {
            self.share
        };
        let left = share.saturating_sub(self.in_flight());
        (left < room).then_some(left)
    }

    /// `retry_share = 1`: retries may use every slot, backed up or not.
    fn off(&self) -> bool {
        self.share >= self.max_in_flight
    }

    /// Whether first attempts back up (retries get one slot).
    pub(super) fn backed_up(&self) -> bool {
        self.backed_up.load(Ordering::Relaxed)
    }

    /// What a round's reserves for the target saw: `full_of_firsts`, whether some
    /// topic's reserve came back full with first attempts in it; `every_topic`,
    /// whether the round reserved from every due topic of the target. Backed up from
    /// the first such reserve until a round of every topic finds none.
    pub(super) fn saw(&self, full_of_firsts: bool, every_topic: bool) {
        if full_of_firsts {
            self.backed_up.store(true, Ordering::Relaxed);
        } else if every_topic {
            self.backed_up.store(false, Ordering::Relaxed);
        }
    }

    /// Counts a job of `attempt` as a retry in flight, if it is one (then `true`),
    /// until [`Lanes::end`].
    pub(super) fn started(&self, attempt: u32) -> bool {
        let retry = attempt > 1;
        if retry {
            self.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        retry
    }

    /// A retry's request ended.
    pub(super) fn end(&self) {
        // Never below zero: an end is only sent for a start.
        self.in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .ok();
        self.ended.fetch_add(1, Ordering::Relaxed);
    }

    /// The count of retries ended so far, read before a capped reserve for
    /// [`Lanes::block`].
    pub(super) fn ended(&self) -> u64 {
        self.ended.load(Ordering::Relaxed)
    }

    /// `topic`'s reserve held retries and took nothing: skip it until a retry ends
    /// after `ended` (read before the reserve: a retry that ended while it ran freed
    /// the lane already, and must not leave the topic waiting for another). Not while
    /// no retry is in flight: none would end to let it go (the cap was then another
    /// topic's, and the next round looks again).
    pub(super) fn block(&self, topic: Topic, ended: u64) {
        if self.in_flight() > 0 {
            self.lock().insert(topic, ended);
        }
    }

    /// `topics` with those whose last capped reserve met retries first, so that a cap
    /// smaller than the count of topics goes where the retries are ([`split`] gives
    /// the first ones more), not to a topic of first attempts only.
    pub(super) fn retries_first(&self, topics: &[Topic]) -> Vec<Topic> {
        let with = self
            .with_retries
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut ordered = topics.to_vec();
        ordered.sort_by_key(|t| !with.contains(t));
        ordered
    }

    /// Whether `topic`'s capped reserve met retries (held or taken).
    pub(super) fn met_retries(&self, topic: &Topic, met: bool) {
        let mut with = self
            .with_retries
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if met {
            with.insert(topic.clone());
        } else {
            with.remove(topic);
        }
    }

    /// Whether `topic` is still blocked (no retry ended since); forgets it if not.
    pub(super) fn blocked(&self, topic: &Topic) -> bool {
        let mut blocked = self.lock();
        match blocked.get(topic) {
            Some(at) if *at == self.ended.load(Ordering::Relaxed) => true,
            Some(_) => {
                blocked.remove(topic);
                false
            }
            None => false,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Topic, u64>> {
        self.blocked.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::{self, UnboundedSender};

    fn gates(targets: &[TargetConfig]) -> (Gates, UnboundedSender<Ended>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let notify = || Arc::new(Notify::new());
        (Gates::new(targets, notify(), notify(), rx, None), tx)
    }

    // The breaker.

    #[test]
    fn a_held_target_is_not_served_and_a_claimed_probe_is_one_job() {
        let target = TargetConfig {
            name: "t".into(),
            ..TargetConfig::default()
        };
        let (health, ended) = gates(&[target]);
        assert_eq!(health.allow(0), Allow::All);
        health.gates[0].lock().state = State::Open;
        assert_eq!(health.allow(0), Allow::Nothing);
        {
            let mut local = health.gates[0].lock();
            local.state = State::HalfOpen;
            local.claimed = true;
        }
        assert_eq!(health.allow(0), Allow::Probe);
        health.probe_sent(0);
        assert_eq!(health.allow(0), Allow::Nothing);
        assert!(!health.pending(0));
        let failed = Ended {
            index: 0,
            probe: false,
            retry: false,
            outcome: Some(Outcome::Failed("x".into())),
        };
        ended.send(failed).expect("the gates hold the receiver");
        assert!(!health.pending(0), "not taken in yet");
        health.absorb();
        assert!(health.pending(0));
        assert_eq!(health.allow(9), Allow::Nothing);
    }

    // The retry lane.

    #[test]
    fn the_share_rounds_down_and_stays_within_the_slots() {
        assert_eq!(share_slots(64, 0.5), 32);
        assert_eq!(share_slots(5, 0.5), 2);
        assert_eq!(share_slots(1, 0.5), 1, "retries always keep one slot");
        assert_eq!(share_slots(8, 0.0), 1, "share 0: one slot, never none");
        assert_eq!(share_slots(8, 1.0), 8);
    }

    #[test]
    fn the_cap_is_the_share_left_and_only_when_it_binds() {
        let lanes = Lanes::new(8, 0.5);
        assert_eq!(
            lanes.cap(8),
            Some(4),
            "an idle target too: 4 of 8 for retries"
        );
        assert_eq!(lanes.cap(4), None, "4 free slots: a cap of 4 cannot bind");
        for _ in 0..3 {
            assert!(lanes.started(2));
        }
        assert!(!lanes.started(1), "a first attempt is not counted");
        assert_eq!(lanes.in_flight(), 3);
        assert_eq!(lanes.cap(5), Some(1));
        for _ in 0..3 {
            lanes.started(7);
        }
        assert_eq!(
            lanes.cap(2),
            Some(0),
            "at the share or over it: no more retries"
        );
        for _ in 0..6 {
            lanes.end();
        }
        assert_eq!(lanes.in_flight(), 0);
        lanes.end();
        assert_eq!(lanes.in_flight(), 0, "never below zero");
        assert_eq!(Lanes::new(8, 1.0).cap(8), None, "share 1: never capped");
    }

    #[test]
    fn while_first_attempts_back_up_retries_keep_one_slot() {
        let lanes = Lanes::new(8, 0.5);
        lanes.saw(true, false);
        assert!(lanes.backed_up());
        assert_eq!(lanes.cap(8), Some(1), "one slot for retries, 7 for firsts");
        lanes.started(2);
        assert_eq!(lanes.cap(8), Some(0), "that slot taken: no more retries");
        lanes.saw(false, false);
        assert!(
            lanes.backed_up(),
            "a round that left a due topic out proves nothing"
        );
        lanes.saw(false, true);
        assert!(!lanes.backed_up(), "every topic seen, none full of firsts");
        assert_eq!(
            lanes.cap(8),
            Some(3),
            "the share again: 4, less 1 in flight"
        );
        let off = Lanes::new(8, 1.0);
        off.saw(true, true);
        assert_eq!(off.cap(8), None, "share 1 (lanes off): never capped");
    }

    #[test]
    fn the_cap_is_spread_over_topics_exactly() {
        assert_eq!(split(5, 3), vec![2, 2, 1]);
        assert_eq!(split(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(split(0, 2), vec![0, 0]);
        assert_eq!(split(7, 1), vec![7]);
        assert!(split(3, 0).is_empty());
        for (cap, n) in [(0, 1), (9, 4), (31, 64), (64, 7)] {
            assert_eq!(split(cap, n).iter().sum::<usize>(), cap);
        }
    }

    #[test]
    fn a_blocked_topic_waits_until_a_retry_ends() {
        let lanes = Lanes::new(4, 0.5);
        let topic = Topic::new("t").expect("a topic");
        lanes.started(2);
        lanes.block(topic.clone(), lanes.ended());
        assert!(lanes.blocked(&topic));
        assert!(lanes.blocked(&topic), "still: no retry ended");
        lanes.end();
        assert!(!lanes.blocked(&topic), "a retry ended: look again");
        assert!(!lanes.blocked(&topic));
    }

    #[test]
    fn a_small_cap_goes_to_the_topics_that_met_retries() {
        let lanes = Lanes::new(8, 0.5);
        let (firsts, retries) = (
            Topic::new("firsts").expect("a topic"),
            Topic::new("retries").expect("a topic"),
        );
        let topics = vec![firsts.clone(), retries.clone()];
        assert_eq!(
            lanes.retries_first(&topics),
            topics,
            "nothing known: as given"
        );
        lanes.met_retries(&retries, true);
        assert_eq!(
            lanes.retries_first(&topics),
            vec![retries.clone(), firsts.clone()]
        );
        assert_eq!(
            split(1, 2),
            vec![1, 0],
            "so a cap of 1 is the retries' topic's"
        );
        lanes.met_retries(&retries, false);
        assert_eq!(lanes.retries_first(&topics), topics);
    }

    #[test]
    fn a_topic_is_not_blocked_while_no_retry_is_in_flight() {
        let lanes = Lanes::new(8, 0.5);
        let topic = Topic::new("t").expect("a topic");
        lanes.block(topic.clone(), lanes.ended());
        assert!(
            !lanes.blocked(&topic),
            "no retry in flight would ever end to let it go"
        );
    }

    #[test]
    fn a_retry_that_ended_during_the_reserve_does_not_leave_the_topic_blocked() {
        let lanes = Lanes::new(1, 0.5);
        let topic = Topic::new("t").expect("a topic");
        lanes.started(2);
        let before = lanes.ended();
        lanes.end(); // the only retry in flight ends while the capped reserve runs
        lanes.block(topic.clone(), before);
        assert!(
            !lanes.blocked(&topic),
            "no retry left to end: never blocked"
        );
    }
}

//! Each target's health as this bridge sees it, kept in step with the breaker every
//! bridge shares in Redis (`Store::target_health`, policy in `crate::targets::health`).
//!
//! The round asks [`Health::allow`] before reserving: a closed target is served as
//! usual; an open or disabled one not at all (its jobs stay scheduled and spend no
//! attempt); a half-open one for exactly one job, the probe, once this bridge's sync
//! claimed it in the script (so one probe at a time across all bridges). A request to
//! the target's own URL reports its outcome ([`Health::outcome`]); outcomes are
//! counted here and sent in one `sync` call per target by [`Health::run`]'s task about
//! once a second, at once when a failure, a probe's outcome or a 410 is pending (the
//! round syncs a target with pending failures itself before reserving for it, so the
//! breaker opens within `min_requests`), every 100 ms while the target is held. A
//! success while closed costs no round trip.
//!
//! The changes a script call took are announced here, once: logged, counted
//! (`redisched_webhook_target_transitions_total`), and handed to the events publisher
//! (`crate::events`); the state gauge follows every sync.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::client::{Delivered, Failure};
use crate::events::EventSender;
use crate::metrics::Metrics;
use crate::store::{HealthOp, Store, TargetHealth};
use crate::targets::health::{Change, State};
use crate::targets::{BreakerConfig, TargetConfig};

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

/// What one request to the target's own URL says of its health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Outcome {
    Ok,
    /// A 5xx, a 429, a timeout, no connection.
    Failed(String),
    /// 410 Gone.
    Gone(String),
}

/// What a request's result says (the book's *Target health* defines it).
pub(super) fn judge(result: &Result<Delivered, Failure>) -> Outcome {
    match result {
        Ok(_) => Outcome::Ok,
        Err(f) if f.status == Some(410) => Outcome::Gone(f.reason.clone()),
        Err(f)
            if f.status == Some(429) || matches!(f.code, "5xx" | "timeout" | "connect" | "tls") =>
        {
            Outcome::Failed(f.reason.clone())
        }
        Err(_) => Outcome::Ok,
    }
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

#[derive(Debug)]
struct Gate {
    name: String,
    breaker: BreakerConfig,
    lease_ms: u64,
    local: Mutex<Local>,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, Local> {
        self.local.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every target's health, by the sink's target index.
#[derive(Debug)]
pub(super) struct Health {
    gates: Vec<Gate>,
    /// Wakes the sync task (an outcome to send).
    wake: Notify,
    /// The dispatch loop's: signalled when a held target may be served again.
    room: Arc<Notify>,
    events: Option<EventSender>,
    started: AtomicBool,
}

impl Health {
    pub(super) fn new(
        targets: &[TargetConfig],
        room: Arc<Notify>,
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
            })
            .collect();
        Self {
            gates,
            wake: Notify::new(),
            room,
            events,
            started: AtomicBool::new(false),
        }
    }

    /// What the round may reserve for target `index`.
    pub(super) fn allow(&self, index: usize) -> Allow {
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
    pub(super) fn probe_sent(&self, index: usize) {
        if let Some(gate) = self.gates.get(index) {
            gate.lock().claimed = false;
        }
    }

    /// A request to target `index`'s own URL ended (`probe`: it was the probe).
    pub(super) fn outcome(&self, index: usize, probe: bool, outcome: Outcome) {
        let Some(gate) = self.gates.get(index) else {
            return;
        };
        let mut local = gate.lock();
        let urgent = match (outcome, probe) {
            (Outcome::Gone(reason), _) => {
                local.ops.push(HealthOp::Gone { reason });
                true
            }
            (Outcome::Ok, true) => {
                local.ops.push(HealthOp::Probe {
                    ok: true,
                    reason: String::new(),
                });
                true
            }
            (Outcome::Failed(reason), true) => {
                local.ops.push(HealthOp::Probe {
                    ok: false,
                    reason: format!("the probe request failed: {reason}"),
                });
                true
            }
            (Outcome::Ok, false) => {
                local.successes += 1;
                false
            }
            (Outcome::Failed(reason), false) => {
                local.failures += 1;
                local.last_failure = reason;
                true
            }
        };
        drop(local);
        if urgent {
            self.wake.notify_one();
        }
    }

    /// Whether target `index` has failures or other outcomes not yet sent.
    pub(super) fn pending(&self, index: usize) -> bool {
        self.gates.get(index).is_some_and(|g| {
            let local = g.lock();
            local.failures > 0 || !local.ops.is_empty()
        })
    }

    /// Starts the sync task once (at the first round: it needs the store).
    pub(super) fn start(
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
    pub(super) async fn sync(&self, index: usize, store: &Store, metrics: &Metrics) {
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
                Ok(answer) => self.take(gate, answer, metrics),
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

    fn take(&self, gate: &Gate, answer: TargetHealth, metrics: &Metrics) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(code: &'static str, status: Option<u16>) -> Result<Delivered, Failure> {
        Err(Failure {
            code,
            status,
            reason: "r".into(),
            retry_after: None,
        })
    }

    #[test]
    fn a_failure_is_a_5xx_a_429_a_timeout_or_no_connection() {
        assert_eq!(judge(&Ok(Delivered { status: 200 })), Outcome::Ok);
        for (code, status) in [
            ("5xx", Some(503)),
            ("4xx", Some(429)),
            ("timeout", None),
            ("connect", None),
            ("tls", None),
        ] {
            assert!(
                matches!(judge(&failure(code, status)), Outcome::Failed(_)),
                "{code}"
            );
        }
        assert!(matches!(
            judge(&failure("4xx", Some(410))),
            Outcome::Gone(_)
        ));
        assert_eq!(
            judge(&failure("4xx", Some(404))),
            Outcome::Ok,
            "it answered"
        );
    }

    #[test]
    fn a_held_target_is_not_served_and_a_claimed_probe_is_one_job() {
        let target = TargetConfig {
            name: "t".into(),
            ..TargetConfig::default()
        };
        let health = Health::new(&[target], Arc::new(Notify::new()), None);
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
        health.outcome(0, false, Outcome::Failed("x".into()));
        assert!(health.pending(0));
        assert_eq!(health.allow(9), Allow::Nothing);
    }
}

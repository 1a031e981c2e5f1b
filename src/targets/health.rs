//! A target's health: its circuit breaker's settings (`[targets.breaker]`), its states,
//! the state change an event announces ([`Change`]), and the transition policy as a
//! pure function ([`step`]) that `lua/target_health.lua` mirrors line for line (the
//! script is what runs; the unit tests below pin the rules both follow).
//!
//! A failure is an answer of the target's own URL that says it is unwell: a 5xx, a
//! 429, a timeout, or no connection (connect or TLS); any other answer counts as a
//! request that did not fail. Requests to a job's own URL count for nothing.

use serde::{Deserialize, Serialize};

/// `[targets.breaker]`: when the breaker opens, and how long it stays open.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Failures / requests in the window at or above which the breaker opens.
    pub failure_ratio: f64,
    /// The counting window (fixed: its counts start afresh when it has run out).
    pub window_ms: u64,
    /// Requests the window must hold before the ratio counts.
    pub min_requests: u64,
    /// How long it stays open before one probe request decides.
    pub open_ms: u64,
    /// Opening this many times in a row (no `closed` between) disables the target.
    pub disable_after_trips: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_ratio: 0.7,
            window_ms: 300_000,
            min_requests: 10,
            open_ms: 30_000,
            disable_after_trips: 10,
        }
    }
}

impl BreakerConfig {
    /// The first key that is out of range, with why.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.failure_ratio > 0.0 && self.failure_ratio <= 1.0) {
            return Err(("failure_ratio", "must be above 0 and at most 1".into()));
        }
        for (key, value) in [
            ("window_ms", self.window_ms),
            ("min_requests", self.min_requests),
            ("open_ms", self.open_ms),
            ("disable_after_trips", self.disable_after_trips),
        ] {
            if value == 0 || value > 1_000_000_000_000 {
                return Err((key, "must be 1 .. 1000000000000".into()));
            }
        }
        Ok(())
    }
}

/// Where a target's breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Closed,
    Open,
    HalfOpen,
    Disabled,
}

impl State {
    pub const ALL: [State; 4] = [State::Closed, State::Open, State::HalfOpen, State::Disabled];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
            State::Disabled => "disabled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.as_str() == s)
    }

    /// Whether the target's topics are reserved at all (half-open: one probe only).
    pub fn holds(self) -> bool {
        self != State::Closed
    }
}

/// One state change, as logged, counted and published (`target.<to>` on
/// `redisched.events`): `to` is a state's name or `enabled`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    pub target: String,
    #[serde(rename = "state")]
    pub to: String,
    pub reason: String,
    /// RFC 3339, UTC.
    pub at: String,
}

/// The stored health of a target (the fields of its hash in Redis).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    pub state: State,
    pub window_start: i64,
    pub requests: u64,
    pub failures: u64,
    pub opened_at: i64,
    /// Opens in a row, with no `closed` between.
    pub trips: u64,
    /// Until when the half-open probe is claimed (0: unclaimed).
    pub probe_until: i64,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            state: State::Closed,
            window_start: 0,
            requests: 0,
            failures: 0,
            opened_at: 0,
            trips: 0,
            probe_until: 0,
        }
    }
}

/// What a script call tells the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Outcomes counted since the last sync; `lease_ms` > 0 claims the probe if due.
    Sync {
        successes: u64,
        failures: u64,
        lease_ms: i64,
    },
    /// The probe's outcome.
    Probe {
        ok: bool,
    },
    /// The target's own URL answered 410 Gone.
    Gone,
    Enable,
    Disable,
}

/// Applies `input` at `now`; returns the changes made (`to` names, in order) and
/// whether this call claimed the probe.
pub fn step(
    h: &mut Health,
    cfg: &BreakerConfig,
    input: Input,
    now: i64,
) -> (Vec<&'static str>, bool) {
    let mut changes = Vec::new();
    let mut claimed = false;
    let window = i64::try_from(cfg.window_ms).unwrap_or(i64::MAX);
    match input {
        Input::Sync {
            successes,
            failures,
            lease_ms,
        } => {
            if h.state == State::Closed {
                if now - h.window_start >= window {
                    (h.window_start, h.requests, h.failures) = (now, 0, 0);
                }
                h.requests += successes + failures;
                h.failures += failures;
                let ratio = h.failures as f64 / h.requests.max(1) as f64;
                if h.requests >= cfg.min_requests && ratio >= cfg.failure_ratio {
                    changes.push(trip(h, cfg, now));
                }
            }
            let open = i64::try_from(cfg.open_ms).unwrap_or(i64::MAX);
            if h.state == State::Open && now - h.opened_at >= open {
                h.state = State::HalfOpen;
                h.probe_until = 0;
                changes.push("half_open");
            }
            if h.state == State::HalfOpen && lease_ms > 0 && h.probe_until <= now {
                h.probe_until = now + lease_ms;
                claimed = true;
            }
        }
        Input::Probe { ok } if h.state == State::HalfOpen => {
            if ok {
                close(h, now);
                changes.push("closed");
            } else {
                changes.push(trip(h, cfg, now));
            }
        }
        Input::Probe { .. } => {}
        Input::Gone | Input::Disable if h.state != State::Disabled => {
            h.state = State::Disabled;
            changes.push("disabled");
        }
        Input::Gone | Input::Disable => {}
        Input::Enable => {
            let was = h.state;
            close(h, now);
            match was {
                State::Disabled => changes.push("enabled"),
                State::Open | State::HalfOpen => changes.push("closed"),
                State::Closed => {}
            }
        }
    }
    (changes, claimed)
}

/// Opens the breaker (one more trip), or disables the target at the last trip allowed.
fn trip(h: &mut Health, cfg: &BreakerConfig, now: i64) -> &'static str {
    h.trips += 1;
    h.opened_at = now;
    h.probe_until = 0;
    if h.trips >= cfg.disable_after_trips {
        h.state = State::Disabled;
        "disabled"
    } else {
        h.state = State::Open;
        "open"
    }
}

fn close(h: &mut Health, now: i64) {
    *h = Health {
        window_start: now,
        ..Health::default()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failure_ratio: 0.7,
            window_ms: 1000,
            min_requests: 10,
            open_ms: 500,
            disable_after_trips: 3,
        }
    }

    fn sync(s: u64, f: u64, lease_ms: i64) -> Input {
        Input::Sync {
            successes: s,
            failures: f,
            lease_ms,
        }
    }

    #[test]
    fn opens_at_the_ratio_once_min_requests_are_counted() {
        let (mut h, c) = (Health::default(), cfg());
        assert_eq!(step(&mut h, &c, sync(0, 9, 0), 10).0, Vec::<&str>::new());
        assert_eq!(h.state, State::Closed, "9 failures < min_requests");
        assert_eq!(step(&mut h, &c, sync(0, 1, 0), 20).0, vec!["open"]);
        assert_eq!((h.state, h.trips, h.opened_at), (State::Open, 1, 20));
    }

    #[test]
    fn a_ratio_below_the_threshold_keeps_it_closed_and_the_window_starts_afresh() {
        let (mut h, c) = (Health::default(), cfg());
        step(&mut h, &c, sync(4, 6, 0), 0);
        assert_eq!(h.state, State::Closed, "6 of 10 < 0.7");
        // The window ran out: its counts start again.
        step(&mut h, &c, sync(0, 9, 0), 1500);
        assert_eq!((h.state, h.requests, h.failures), (State::Closed, 9, 9));
        step(&mut h, &c, sync(0, 1, 0), 1600);
        assert_eq!(h.state, State::Open);
    }

    #[test]
    fn half_open_after_open_ms_with_one_probe_claimed_at_a_time() {
        let (mut h, c) = (Health::default(), cfg());
        step(&mut h, &c, sync(0, 10, 0), 0);
        assert_eq!(step(&mut h, &c, sync(0, 0, 100), 499), (vec![], false));
        assert_eq!(
            step(&mut h, &c, sync(0, 0, 100), 500),
            (vec!["half_open"], true)
        );
        assert_eq!(
            step(&mut h, &c, sync(0, 0, 100), 550),
            (vec![], false),
            "claimed"
        );
        assert_eq!(
            step(&mut h, &c, sync(0, 0, 100), 600),
            (vec![], true),
            "lease over"
        );
        assert_eq!(
            step(&mut h, &c, Input::Probe { ok: true }, 610).0,
            vec!["closed"]
        );
        assert_eq!((h.state, h.trips, h.requests), (State::Closed, 0, 0));
    }

    #[test]
    fn a_failed_probe_opens_again_and_trips_in_a_row_disable() {
        let (mut h, c) = (Health::default(), cfg());
        step(&mut h, &c, sync(0, 10, 0), 0);
        step(&mut h, &c, sync(0, 0, 100), 500);
        assert_eq!(
            step(&mut h, &c, Input::Probe { ok: false }, 510).0,
            vec!["open"]
        );
        assert_eq!((h.trips, h.opened_at), (2, 510));
        step(&mut h, &c, sync(0, 0, 100), 1010);
        assert_eq!(
            step(&mut h, &c, Input::Probe { ok: false }, 1020).0,
            vec!["disabled"]
        );
        assert_eq!(h.state, State::Disabled);
        assert_eq!(
            step(&mut h, &c, sync(0, 0, 100), 9999),
            (vec![], false),
            "stays"
        );
        assert_eq!(step(&mut h, &c, Input::Enable, 10_000).0, vec!["enabled"]);
        assert_eq!((h.state, h.trips), (State::Closed, 0));
    }

    #[test]
    fn outcomes_while_open_and_stale_probes_change_nothing() {
        let (mut h, c) = (Health::default(), cfg());
        step(&mut h, &c, sync(0, 10, 0), 0);
        step(&mut h, &c, sync(5, 5, 0), 10);
        assert_eq!((h.requests, h.failures), (10, 10), "not counted while open");
        assert_eq!(
            step(&mut h, &c, Input::Probe { ok: true }, 20).0,
            Vec::<&str>::new()
        );
        assert_eq!(h.state, State::Open);
    }

    #[test]
    fn gone_disables_at_once_and_enable_or_disable_by_hand() {
        let (mut h, c) = (Health::default(), cfg());
        assert_eq!(step(&mut h, &c, Input::Gone, 5).0, vec!["disabled"]);
        assert_eq!(step(&mut h, &c, Input::Gone, 6).0, Vec::<&str>::new());
        assert_eq!(step(&mut h, &c, Input::Enable, 7).0, vec!["enabled"]);
        assert_eq!(step(&mut h, &c, Input::Enable, 8).0, Vec::<&str>::new());
        assert_eq!(step(&mut h, &c, Input::Disable, 9).0, vec!["disabled"]);
    }

    #[test]
    fn the_breaker_settings_are_checked_by_key() {
        assert!(BreakerConfig::default().check().is_ok());
        let bad = BreakerConfig {
            failure_ratio: 1.5,
            ..BreakerConfig::default()
        };
        assert_eq!(bad.check().unwrap_err().0, "failure_ratio");
        let bad = BreakerConfig {
            open_ms: 0,
            ..BreakerConfig::default()
        };
        assert_eq!(bad.check().unwrap_err().0, "open_ms");
    }
}

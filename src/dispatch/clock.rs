//! The Redis server's clock as seen from this process ([`ServerClock`]): every due
//! time refers to it, so sleeping "until a job is due" must too, whatever the local
//! clock says. A value every step of dispatch reads (the turn to know what is due and
//! how long to sleep, the reserve to judge expiry, the settle for lateness and a
//! series' next occurrence) and each server reading corrects; it calls nothing else.
//!
//! Each server reading is a whole millisecond (the floor of the server's time) taken
//! somewhere between a call's send and its reply, so it bounds the offset between the
//! server's clock and the local monotonic one from both sides. The bounds of all
//! readings are intersected (NTP's interval idea), widened over time by a drift
//! allowance, and `now()` reads the lower bound: never ahead of the server, so a loop
//! never wakes early, and within a fraction of a millisecond of it once a few replies
//! came back fast. Reading only the last reply (as before) lagged the server by its
//! floor, the reply's transit and the floor of the time since: about 1 ms on average,
//! all of it lateness.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How fast the two clocks may drift apart, in µs per second: the bounds widen by this
/// much between readings (500 ppm is the most NTP slews a clock).
const DRIFT_US_PER_S: f64 = 500.0;

#[derive(Debug)]
pub struct ServerClock {
    /// Local instants are measured from here (µs).
    origin: Instant,
    bounds: Mutex<Bounds>,
}

/// The server's clock minus the local one (µs since `origin`), known to lie in
/// `[low, high]` as of the local time `at` (µs); before the first reading, both are
/// the local wall clock's offset, a guess that the first reading replaces.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    low: f64,
    high: f64,
    at: f64,
    guessed: bool,
}

impl Bounds {
    /// The bounds at local time `t`: wider by the drift allowed since `at`.
    fn aged(self, t: f64) -> (f64, f64) {
        let slack = (t - self.at).max(0.0) * DRIFT_US_PER_S / 1e6;
        (self.low - slack, self.high + slack)
    }
}

impl ServerClock {
    /// Starts from the local clock until the first server reading arrives.
    pub fn new() -> Self {
        let local_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as f64)
            .unwrap_or(0.0);
        let offset = local_ms * 1000.0;
        Self {
            origin: Instant::now(),
            bounds: Mutex::new(Bounds {
                low: offset,
                high: offset,
                at: 0.0,
                guessed: true,
            }),
        }
    }

    fn local_us(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }

    /// A server reading (epoch ms, the floor of its clock) from a call sent at `sent`
    /// whose reply has just arrived. A reading that contradicts the bounds (the server's
    /// clock was stepped, or another server answered) starts them afresh from itself.
    pub fn observe(&self, server_ms: i64, sent: Instant) {
        let arrived = self.local_us(Instant::now());
        let sent = self.local_us(sent).min(arrived);
        let server_us = server_ms as f64 * 1000.0;
        // Read at some local time in [sent, arrived], of a server time in
        // [server_us, server_us + 1 ms).
        let (low, high) = (server_us - arrived, server_us + 1000.0 - sent);
        let mut bounds = self.bounds();
        let (old_low, old_high) = bounds.aged(arrived);
        let (joint_low, joint_high) = (low.max(old_low), high.min(old_high));
        *bounds = if joint_low <= joint_high && !bounds.guessed {
            Bounds {
                low: joint_low,
                high: joint_high,
                at: arrived,
                guessed: false,
            }
        } else {
            Bounds {
                low,
                high,
                at: arrived,
                guessed: false,
            }
        };
    }

    /// The server's clock now, epoch ms: the lower bound, so never ahead of it.
    pub fn now(&self) -> i64 {
        let t = self.local_us(Instant::now());
        let (low, _) = self.bounds().aged(t);
        ((t + low) / 1000.0).floor() as i64
    }

    /// The local instant at which the server's clock will have reached `due_ms` (by
    /// the lower bound, so not before); now if it has.
    pub fn instant_of(&self, due_ms: i64) -> Instant {
        let now = Instant::now();
        let t = self.local_us(now);
        let (low, _) = self.bounds().aged(t);
        // Aging lowers the bound further as time passes; at this range (milliseconds
        // to a poll interval) that is under a microsecond per millisecond waited.
        let wait_us = due_ms as f64 * 1000.0 - low - t;
        if wait_us <= 0.0 {
            return now;
        }
        now + Duration::from_secs_f64(wait_us / 1e6)
    }

    /// The bounds, also after a thread panicked while holding the lock: they are always
    /// whole (written in one assignment), so the last ones stand. (A poisoned lock once
    /// made `now()` answer 0, the epoch: every due time "in the future", a silent
    /// dispatch stall.)
    fn bounds(&self) -> MutexGuard<'_, Bounds> {
        self.bounds.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for ServerClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_keeps_the_last_reading() {
        let clock = std::sync::Arc::new(ServerClock::new());
        clock.observe(1_000_000, Instant::now());
        let held = clock.clone();
        let panicked = std::thread::spawn(move || {
            let _guard = held.bounds.lock();
            panic!("poison the clock's lock");
        })
        .join();
        assert!(panicked.is_err(), "the thread panicked holding the lock");
        assert!(clock.bounds.is_poisoned());
        let now = clock.now();
        assert!((1_000_000..1_010_000).contains(&now), "{now}");
        clock.observe(2_000_000, Instant::now());
        assert!(clock.now() >= 2_000_000);
    }

    /// A simulated server whose clock is the local one plus `offset_us`, answering
    /// after `transit_us` each way: readings narrow the bounds towards the true offset
    /// from below, and `now()` never runs ahead of the server.
    #[test]
    fn readings_narrow_the_estimate_and_it_never_runs_ahead() {
        let clock = ServerClock::new();
        let offset_us = 1_700_000_000_123_456.7_f64;
        let server_at = |local: Instant| clock.local_us(local) + offset_us;
        for i in 0..200 {
            let sent = Instant::now();
            // The server reads its clock, floored to a millisecond.
            let reading = (server_at(Instant::now()) / 1000.0).floor() as i64;
            // Vary where in the millisecond the readings fall.
            std::thread::sleep(Duration::from_micros(37 + (i * 53) % 400));
            clock.observe(reading, sent);
            let estimate = clock.now();
            let truth = (server_at(Instant::now()) / 1000.0).floor() as i64;
            assert!(estimate <= truth, "ran ahead: {estimate} > {truth}");
        }
        // After 200 readings the lower bound is within a millisecond of the truth
        // (usually far less; the sleep between reading and reply is the noise).
        let bounds = *clock.bounds();
        assert!(
            offset_us - bounds.low < 1_000.0,
            "lower bound {} µs below",
            offset_us - bounds.low
        );
        assert!(bounds.low <= offset_us + 1.0 && bounds.high >= offset_us - 1.0);
        // The instant of a due time one second ahead is about a second away, never
        // before the server gets there.
        let due = (server_at(Instant::now()) / 1000.0).floor() as i64 + 1_000;
        let wake = clock.instant_of(due);
        assert!(server_at(wake) >= due as f64 * 1000.0 - 1.0);
        assert!(wake.saturating_duration_since(Instant::now()) <= Duration::from_millis(1_001));
    }

    #[test]
    fn a_reading_that_contradicts_the_bounds_starts_them_afresh() {
        let clock = ServerClock::new();
        clock.observe(5_000_000, Instant::now());
        assert!(clock.now() >= 5_000_000);
        // The server's clock was stepped back a minute: the old bounds cannot hold it.
        clock.observe(4_940_000, Instant::now());
        let now = clock.now();
        assert!((4_940_000..4_941_000).contains(&now), "{now}");
    }
}

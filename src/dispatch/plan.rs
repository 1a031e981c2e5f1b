//! When a sink's loop next has work, by the clock that decides it: one step of a job's
//! path, its topic's next due time and the instant to sleep until. The [`Plan`] is what
//! the loop knows of when each of its topics is next due (kept across AMQP sessions):
//! planned from reserve replies, hints and rescans; paused topics left out for a while,
//! and (while spans are exported) each topic's last pause on the Redis clock (`Pause`).
//! The [`ServerClock`] is the Redis server's clock as seen from this process: every due
//! time refers to it, so sleeping "until a job is due" must too, whatever the local
//! clock says.
//!
//! The clock: each server reading is a whole millisecond (the floor of the server's
//! time) taken somewhere between a call's send and its reply, so it bounds the offset
//! between the server's clock and the local monotonic one from both sides. The bounds of
//! all readings are intersected (NTP's interval idea), widened over time by a drift
//! allowance, and `now()` reads the lower bound: never ahead of the server, so a loop
//! never wakes early, and within a fraction of a millisecond of it once a few replies
//! came back fast. Reading only the last reply (as before) lagged the server by its
//! floor, the reply's transit and the floor of the time since: about 1 ms on average,
//! all of it lateness.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::job::Topic;

/// How long a topic found paused is left out of the plan before a rescan looks at it
/// again. A resume wakes dispatchers at once (Pub/Sub); this only bounds the wait after
/// a resume that notified no one (e.g. `resume.lua` called without the channel).
const PAUSED_RECHECK: Duration = Duration::from_secs(5);

/// What the dispatcher knows between AMQP sessions: when each topic is next due,
/// indexed both ways so a tick costs O(log topics), not a pass over all of them.
#[derive(Debug, Default)]
pub struct Plan {
    pub(super) next_due: HashMap<Topic, i64>,
    pub(super) by_due: BTreeSet<(i64, Topic)>,
    pub(super) last_rescan: Option<Instant>,
    /// Where the incremental rescan of the topic set stands (an SSCAN cursor).
    pub(super) cursor: u64,
    /// Rotates the starting topic so a hot topic cannot starve the others.
    turn: usize,
    /// Topics the reserve script found paused, and when: their due jobs wait, so the
    /// plan leaves them out instead of asking again on every pass (no spinning).
    pub(super) paused: HashMap<Topic, Instant>,
    /// Each topic's last pause, recorded only while spans are exported (for their
    /// `redisched.paused_ms`); an ended one is kept while a job due during it waits.
    pauses: HashMap<Topic, Pause>,
}

/// A topic's pause as this loop saw it, on the Redis clock (epoch ms): from the time
/// `lua/pause.lua` wrote to the `now` of the first reserve reply that found the topic
/// running again (`None` while it lasts, when the topic gives no jobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pause {
    since: i64,
    until: Option<i64>,
}

impl Plan {
    /// Records a topic's earliest due time (`None`: nothing scheduled).
    pub(super) fn set(&mut self, topic: &Topic, due: Option<i64>) {
        if let Some(old) = self.next_due.remove(topic) {
            self.by_due.remove(&(old, topic.clone()));
        }
        if let Some(due) = due {
            self.next_due.insert(topic.clone(), due);
            self.by_due.insert((due, topic.clone()));
        }
    }

    /// Moves a topic's due time earlier (a hint never delays a topic).
    pub(super) fn lower(&mut self, topic: Topic, due: i64) {
        if self.next_due.get(&topic).is_none_or(|&known| due < known) {
            self.set(&topic, Some(due));
        }
    }

    /// Topics due at `now`, earliest first.
    pub(super) fn due(&self, now: i64) -> Vec<Topic> {
        self.by_due
            .iter()
            .take_while(|(due, _)| *due <= now)
            .map(|(_, topic)| topic.clone())
            .collect()
    }

    /// Topics due at `now`, starting at another one each round, so that none is always
    /// served last.
    pub(super) fn due_in_turn(&mut self, now: i64) -> Vec<Topic> {
        let mut due = self.due(now);
        if !due.is_empty() {
            self.turn = self.turn.wrapping_add(1);
            let start = self.turn % due.len();
            due.rotate_left(start);
        }
        due
    }

    #[cfg(test)]
    fn earliest(&self) -> Option<i64> {
        self.by_due.first().map(|(due, _)| *due)
    }

    /// The earliest due time of a topic not in `skip` (topics waiting for a sink slot).
    pub(super) fn earliest_except(&self, skip: &HashSet<Topic>) -> Option<i64> {
        self.by_due
            .iter()
            .find(|(_, topic)| !skip.contains(topic))
            .map(|(due, _)| *due)
    }

    /// A reserve reply: a paused topic leaves the plan until a hint (resume, put) or
    /// [`PAUSED_RECHECK`]; otherwise its next due time is recorded.
    pub(super) fn reserved(&mut self, topic: &Topic, paused: bool, next_due: Option<i64>) {
        if paused {
            self.paused.insert(topic.clone(), Instant::now());
            self.set(topic, None);
        } else {
            self.paused.remove(topic);
            self.set(topic, next_due);
        }
    }

    /// Whether a reply that found `topic` paused starts a pause not recorded yet (then
    /// read since when, for [`Plan::pause_began`]).
    pub(super) fn pause_is_new(&self, topic: &Topic) -> bool {
        self.pauses
            .get(topic)
            .is_none_or(|pause| pause.until.is_some())
    }

    pub(super) fn pause_began(&mut self, topic: &Topic, since: i64) {
        let pause = Pause { since, until: None };
        self.pauses.insert(topic.clone(), pause);
    }

    /// A reply that found `topic` running at `now`, its earliest waiting job due at
    /// `next_due`: ends the topic's pause if one lasts, and answers its last pause
    /// (paused at, resumed at) for the jobs the reply took. Once no waiting job was due
    /// before the resume, the pause is forgotten.
    pub(super) fn pause_before(
        &mut self,
        topic: &Topic,
        now: i64,
        next_due: Option<i64>,
    ) -> Option<(i64, i64)> {
        // The usual case, no topic paused: no lookup.
        if self.pauses.is_empty() {
            return None;
        }
        let pause = self.pauses.get_mut(topic)?;
        let until = *pause.until.get_or_insert(now);
        let ended = (pause.since, until);
        if next_due.is_none_or(|due| due >= until) {
            self.pauses.remove(topic);
        }
        Some(ended)
    }

    /// A hint: the topic's head moved earlier, or it was resumed.
    pub(super) fn hinted(&mut self, topic: Topic, due: i64) {
        self.paused.remove(&topic);
        self.lower(topic, due);
    }

    /// A rescan's reading of a topic's head; a topic recently found paused is skipped.
    pub(super) fn rescanned(&mut self, topic: &Topic, head: Option<i64>) {
        match self.paused.get(topic) {
            Some(at) if at.elapsed() < PAUSED_RECHECK => self.set(topic, None),
            _ => {
                self.paused.remove(topic);
                self.set(topic, head);
            }
        }
    }
}

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

    fn t(name: &str) -> Topic {
        Topic::new(name).unwrap()
    }

    #[test]
    fn the_plan_orders_topics_by_due_time_and_hints_only_move_them_earlier() {
        let mut plan = Plan::default();
        plan.set(&t("a"), Some(300));
        plan.set(&t("b"), Some(100));
        plan.set(&t("c"), Some(200));
        assert_eq!(plan.earliest(), Some(100));
        assert_eq!(plan.due(250), vec![t("b"), t("c")]);

        plan.lower(t("a"), 50);
        plan.lower(t("b"), 500); // later than known: ignored
        assert_eq!(plan.due(150), vec![t("a"), t("b")]);

        plan.set(&t("a"), None);
        plan.set(&t("b"), Some(400));
        assert_eq!(plan.due(1_000), vec![t("c"), t("b")]);
        assert_eq!(plan.next_due.len(), plan.by_due.len(), "both indexes agree");
    }

    #[test]
    fn each_round_starts_at_another_due_topic() {
        let mut plan = Plan::default();
        for name in ["a", "b", "c"] {
            plan.set(&t(name), Some(100));
        }
        let firsts: Vec<Topic> = (0..3).map(|_| plan.due_in_turn(1_000)[0].clone()).collect();
        assert_eq!(firsts, vec![t("b"), t("c"), t("a")]);
        assert!(plan.due_in_turn(50).is_empty());
        assert_eq!(
            plan.due_in_turn(1_000)[0],
            t("b"),
            "an empty round turns nothing"
        );
    }

    #[test]
    fn a_paused_topic_leaves_the_plan_until_a_hint_or_the_recheck() {
        let mut plan = Plan::default();
        plan.set(&t("paused"), Some(100));
        plan.set(&t("flowing"), Some(100));
        // The reserve script refused the paused topic: it is no longer due, so the loop
        // does not ask again and again, while the other topic stays planned.
        plan.reserved(&t("paused"), true, None);
        assert_eq!(plan.due(1_000), vec![t("flowing")]);
        // A rescan soon after does not bring it back ...
        plan.rescanned(&t("paused"), Some(100));
        assert_eq!(plan.due(1_000), vec![t("flowing")]);
        // ... a hint (the resume notification, a put) does, at once.
        plan.hinted(t("paused"), 100);
        assert_eq!(plan.due(1_000), vec![t("flowing"), t("paused")]);
        assert!(plan.paused.is_empty());
        // Found paused again, then the recheck interval passes: a rescan looks again.
        plan.reserved(&t("paused"), true, None);
        if let Some(at) = plan.paused.get_mut(&t("paused")) {
            *at -= PAUSED_RECHECK;
        }
        plan.rescanned(&t("paused"), Some(100));
        assert_eq!(plan.due(1_000), vec![t("flowing"), t("paused")]);
    }

    #[test]
    fn a_pause_ends_at_the_first_reply_that_finds_the_topic_running() {
        let mut plan = Plan::default();
        assert_eq!(plan.pause_before(&t("a"), 500, None), None, "none recorded");
        assert!(plan.pause_is_new(&t("a")));
        plan.pause_began(&t("a"), 1_000);
        // Found paused again: the same pause, not read again.
        assert!(!plan.pause_is_new(&t("a")));
        assert_eq!(
            plan.pause_before(&t("b"), 2_000, None),
            None,
            "another topic"
        );
        // Running at 3,000 with a job due at 1,500 still waiting: ended, and kept.
        assert_eq!(
            plan.pause_before(&t("a"), 3_000, Some(1_500)),
            Some((1_000, 3_000))
        );
        assert!(
            plan.pause_is_new(&t("a")),
            "a reply found it paused again: a new one"
        );
        // Later replies keep its end; once nothing due before it waits, it is forgotten.
        assert_eq!(
            plan.pause_before(&t("a"), 3_500, Some(3_000)),
            Some((1_000, 3_000))
        );
        assert!(plan.pauses.is_empty());
        assert_eq!(plan.pause_before(&t("a"), 4_000, Some(2_000)), None);
        // Paused again: the new pause replaces the old one.
        plan.pause_began(&t("a"), 5_000);
        assert_eq!(
            plan.pause_before(&t("a"), 6_000, None),
            Some((5_000, 6_000))
        );
        assert!(plan.pauses.is_empty());
    }

    // The server clock.
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

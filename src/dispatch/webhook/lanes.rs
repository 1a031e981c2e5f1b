//! Lanes: a target's retries (attempt > 1) hold at most `retry_share` of its
//! `max_in_flight` slots ([`Lanes`]), and only one while first attempts back up; first
//! attempts may use every slot. So a retry storm against a flaky endpoint never takes
//! the slots fresh deliveries need: first attempts due behind it find `1 - retry_share`
//! of the slots free at once, and every slot a retry frees while they wait. A retry
//! cannot be recalled once sent, so a retry allowed into an idle slot would hold it,
//! when first attempts come, for up to the target's `timeout_ms`; hence the share even
//! while no first attempt waits. The price: a backlog of retries alone drains through
//! its share (`retry_share = 1` lets retries use every slot, and turns lanes off).
//! Retries always keep one slot, so a job's retry is never held forever.
//!
//! First attempts *back up* when a reserve of the target's topic came back full
//! (as many jobs as asked) with first attempts in it: more may be due behind them.
//! That lasts until a round that reserved from every due topic of the target
//! ([`Lanes::saw`]) found none so.
//!
//! Why this shape. Which due job is a retry only the job's record knows, and
//! `lua/reserve.lua` takes earliest first, so the cap is applied where the records are read:
//! the round passes `lua/reserve.lua` a `retry_cap` (the retry slots left: the share minus
//! the retries in flight, spread over the target's due topics by [`split`]), and the
//! script skips the retries past it to reach first attempts behind them (a bounded
//! scan: `limit` + 1000 due jobs at most). A topic whose capped reserve took nothing
//! but held retries waits ([`Lanes::block`]) until a retry of the target ends, rather
//! than being scanned again each round. The count of retries in flight is per bridge,
//! like `max_in_flight`; a [`RetryGuard`] holds one for the request's whole task. A
//! target of `retry_share = 1` (or whose retry slots left cover its free slots) is
//! reserved without a cap, the same call as before lanes.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::job::Topic;

/// One target's retry lane.
#[derive(Debug)]
pub(super) struct Lanes {
    /// `retry_share` × `max_in_flight`, rounded down, at least one: the most slots
    /// retries hold.
    share: usize,
    max_in_flight: usize,
    counts: Arc<Counts>,
    /// Topics whose capped reserve held retries and took nothing, with the count of
    /// retries ended then: skipped until another retry ends.
    blocked: Mutex<HashMap<Topic, u64>>,
    /// Topics whose last capped reserve met retries: first in line for the cap.
    with_retries: Mutex<HashSet<Topic>>,
    /// First attempts back up (see the module's doc): retries get one slot.
    backed_up: AtomicBool,
}

#[derive(Debug, Default)]
struct Counts {
    in_flight: AtomicUsize,
    ended: AtomicU64,
}

/// Counts one retry in flight until dropped (its request's task ended).
#[derive(Debug)]
pub(super) struct RetryGuard(Arc<Counts>);

impl Drop for RetryGuard {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.ended.fetch_add(1, Ordering::Relaxed);
    }
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
            counts: Arc::default(),
            blocked: Mutex::default(),
            with_retries: Mutex::default(),
            backed_up: AtomicBool::new(false),
        }
    }

    /// Retries of this target in flight now (this bridge).
    pub(super) fn in_flight(&self) -> usize {
        self.counts.in_flight.load(Ordering::Relaxed)
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

    /// Counts a job of `attempt` as a retry in flight, if it is one, until the guard
    /// is dropped.
    pub(super) fn start(&self, attempt: u32) -> Option<RetryGuard> {
        (attempt > 1).then(|| {
            self.counts.in_flight.fetch_add(1, Ordering::Relaxed);
            RetryGuard(self.counts.clone())
        })
    }

    /// The count of retries ended so far, read before a capped reserve for
    /// [`Lanes::block`].
    pub(super) fn ended(&self) -> u64 {
        self.counts.ended.load(Ordering::Relaxed)
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
            Some(at) if *at == self.counts.ended.load(Ordering::Relaxed) => true,
            Some(_) => {
                blocked.remove(topic);
                false
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Topic, u64>> {
        self.blocked.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let guards: Vec<_> = (0..3).filter_map(|_| lanes.start(2)).collect();
        assert!(lanes.start(1).is_none(), "a first attempt is not counted");
        assert_eq!(lanes.in_flight(), 3);
        assert_eq!(lanes.cap(5), Some(1));
        let more: Vec<_> = (0..3).filter_map(|_| lanes.start(7)).collect();
        assert_eq!(
            lanes.cap(2),
            Some(0),
            "at the share or over it: no more retries"
        );
        drop(more);
        drop(guards);
        assert_eq!(lanes.in_flight(), 0);
        assert_eq!(Lanes::new(8, 1.0).cap(8), None, "share 1: never capped");
    }

    #[test]
    fn while_first_attempts_back_up_retries_keep_one_slot() {
        let lanes = Lanes::new(8, 0.5);
        lanes.saw(true, false);
        assert!(lanes.backed_up());
        assert_eq!(lanes.cap(8), Some(1), "one slot for retries, 7 for firsts");
        let guard = lanes.start(2);
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
        drop(guard);
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
        let guard = lanes.start(2);
        lanes.block(topic.clone(), lanes.ended());
        assert!(lanes.blocked(&topic));
        assert!(lanes.blocked(&topic), "still: no retry ended");
        drop(guard);
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
        let guard = lanes.start(2);
        let before = lanes.ended();
        drop(guard); // the only retry in flight ends while the capped reserve runs
        lanes.block(topic.clone(), before);
        assert!(
            !lanes.blocked(&topic),
            "no retry left to end: never blocked"
        );
    }
}

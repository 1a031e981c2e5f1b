//! Lanes: a target's retries (attempt > 1) hold at most `retry_share` of its
//! `max_in_flight` slots ([`Lanes`]); first attempts may use every slot. So a retry storm
//! against a flaky endpoint never takes the slots fresh deliveries need, and first
//! attempts due behind it find their share free at once: a retry cannot be recalled
//! once sent, so a retry allowed into an idle slot would hold it, when first attempts
//! come, for up to the target's `timeout_ms`. The price: a backlog of retries alone
//! drains through its share (`retry_share = 1` lets retries use every slot). Retries
//! always keep one slot, so a job's retry is never held forever.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::job::Topic;

/// One target's retry lane.
#[derive(Debug)]
pub(super) struct Lanes {
    /// `retry_share` × `max_in_flight`, rounded down, at least one: the most slots
    /// retries hold.
    share: usize,
    counts: Arc<Counts>,
    /// Topics whose capped reserve held retries and took nothing, with the count of
    /// retries ended then: skipped until another retry ends.
    blocked: Mutex<HashMap<Topic, u64>>,
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
            counts: Arc::default(),
            blocked: Mutex::default(),
        }
    }

    /// Retries of this target in flight now (this bridge).
    pub(super) fn in_flight(&self) -> usize {
        self.counts.in_flight.load(Ordering::Relaxed)
    }

    /// The retries a reserve for `room` free slots may take, or `None` when that cap
    /// could not bind (it covers the room): reserve as usual.
    pub(super) fn cap(&self, room: usize) -> Option<usize> {
        let left = self.share.saturating_sub(self.in_flight());
        (left < room).then_some(left)
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
    /// the lane already, and must not leave the topic waiting for another).
    pub(super) fn block(&self, topic: Topic, ended: u64) {
        self.lock().insert(topic, ended);
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

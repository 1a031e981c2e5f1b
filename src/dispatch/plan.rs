//! When a sink's loop next has work: one step of a job's path, its topic's next due
//! time. The [`Plan`] is what the loop knows of when each of its topics is next due
//! (kept across AMQP sessions), brought up to date once per turn, at its start: from
//! what the last round's reserve replies said (`Learned`, which the reserve fills and
//! never reads back from here), hints and rescans; paused topics left out for a while.
//! The instant to sleep until is read on the Redis server's clock (`clock.rs`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use super::reserve::Learned;
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
    /// What the reserves of the last round said, and each topic's last pause (kept
    /// here so that both last across AMQP sessions).
    pub(super) learned: Learned,
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

    /// Takes in what the last round's reserve replies said, in the order they came.
    pub(super) fn learn(&mut self) {
        for reply in std::mem::take(&mut self.learned.replies) {
            self.reserved(&reply.topic, reply.paused, reply.next_due);
        }
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
}

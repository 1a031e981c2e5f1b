//! The per-topic gauges: a snapshot of what each topic holds, read from Redis at scrape
//! time ([`Metrics::set_topics`]) and written beside the registry's families, with one
//! series per topic that holds something.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::Metrics;

/// What one topic holds now. A topic that holds nothing (all zero, not paused) has no
/// per-topic series at all, so drained topics do not keep series forever.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TopicSnapshot {
    /// Jobs waiting in the schedule, due or not.
    pub scheduled: u64,
    /// Scheduled jobs already due (the backlog).
    pub due: u64,
    /// Jobs handed to a dispatcher, not yet released.
    pub reserved: u64,
    /// Dispatch of the topic is paused.
    pub paused: bool,
    /// Jobs set aside after too many failed attempts, kept for an operator.
    pub parked: u64,
    /// Jobs whose last publish attempt failed and that wait for a retry.
    pub failing: u64,
    /// Due jobs the topic's rate limit holds back (counted in `due` too).
    pub throttled: u64,
}

impl TopicSnapshot {
    fn holds_something(&self) -> bool {
        self.paused || self.scheduled + self.reserved + self.parked + self.failing > 0
    }
}

/// One per-topic gauge family: name, help, and its value in a snapshot.
type TopicGauge = (&'static str, &'static str, fn(&TopicSnapshot) -> u64);

/// The per-topic gauge families. Always described (HELP/TYPE), with one sample per topic
/// that holds something.
pub(super) const TOPIC_GAUGES: [TopicGauge; 7] = [
    (
        "redisched_jobs_scheduled",
        "Jobs waiting in the schedule, due or not.",
        |t| t.scheduled,
    ),
    (
        "redisched_jobs_due",
        "Scheduled jobs already due (the backlog).",
        |t| t.due,
    ),
    (
        "redisched_jobs_reserved",
        "Jobs handed to a dispatcher, not yet released.",
        |t| t.reserved,
    ),
    (
        "redisched_topic_paused",
        "1 while dispatch of the topic is paused.",
        |t| u64::from(t.paused),
    ),
    (
        "redisched_jobs_parked",
        "Jobs set aside after too many failed attempts.",
        |t| t.parked,
    ),
    (
        "redisched_jobs_failing",
        "Jobs whose last publish attempt failed, waiting for a retry.",
        |t| t.failing,
    ),
    (
        "redisched_jobs_throttled",
        "Due jobs the topic's rate limit holds back (all bridges together).",
        |t| t.throttled,
    ),
];

impl Metrics {
    /// Replaces the per-topic snapshot with `topics` (what each topic holds now). Topics
    /// left out, or holding nothing, lose their series. Pass nothing to drop every
    /// per-topic series (e.g. Redis did not answer).
    pub fn set_topics(&self, topics: impl IntoIterator<Item = (String, TopicSnapshot)>) {
        let fresh: BTreeMap<_, _> = topics
            .into_iter()
            .filter(|(_, snapshot)| snapshot.holds_something())
            .collect();
        *self
            .topics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = fresh;
    }

    /// The per-topic gauges: the same lines in both formats (gauges have no suffix).
    pub(super) fn encode_topics(&self, out: &mut String) {
        let topics = self
            .topics
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Writing into a String cannot fail (`.ok()`).
        for (name, help, value) in TOPIC_GAUGES {
            writeln!(out, "# HELP {name} {help}").ok();
            writeln!(out, "# TYPE {name} gauge").ok();
            for (topic, snapshot) in topics.iter() {
                writeln!(
                    out,
                    "{name}{{topic=\"{}\"}} {}",
                    escape_label_value(topic),
                    value(snapshot)
                )
                .ok();
            }
        }
    }
}

/// A label value as both formats want it: backslash, double quote and newline escaped.
fn escape_label_value(value: &str) -> String {
    let mut escaped = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::super::Format;
    use super::*;

    #[test]
    fn only_topics_holding_something_have_series() {
        let metrics = Metrics::new();
        let busy = TopicSnapshot {
            scheduled: 3,
            due: 1,
            ..TopicSnapshot::default()
        };
        let paused = TopicSnapshot {
            paused: true,
            ..TopicSnapshot::default()
        };
        metrics.set_topics([
            ("busy".to_string(), busy),
            ("empty".to_string(), TopicSnapshot::default()),
            ("held".to_string(), paused),
        ]);
        let text = metrics.encode_as(Format::Classic);
        assert!(
            text.contains("redisched_jobs_scheduled{topic=\"busy\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("redisched_jobs_parked{topic=\"busy\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("redisched_topic_paused{topic=\"held\"} 1\n"),
            "{text}"
        );
        assert!(!text.contains("topic=\"empty\""), "{text}");

        metrics.set_topics([("busy".to_string(), TopicSnapshot::default())]);
        let text = metrics.encode_as(Format::Classic);
        assert!(!text.contains("topic="), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}

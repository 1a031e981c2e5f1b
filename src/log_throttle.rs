//! Warnings that stay readable under a flood: the first occurrence of each kind of
//! trouble per topic is logged at once, repeats within a window are only counted, and
//! one summary line per key and window says how many there were.
//!
//! 5,000 invalid commands, or an unroutable job retried every second, would otherwise
//! write a WARN line each and bury everything else. Metrics keep the exact counts; the
//! log keeps the first occurrence (with its detail) and the rate.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a repeated warning may produce a line.
pub const WINDOW: Duration = Duration::from_secs(10);

/// Keys beyond this many are not tracked: their warnings are logged one by one, so a
/// flood over endlessly many topics cannot grow the map without bound.
const MAX_KEYS: usize = 10_000;

#[derive(Debug)]
struct Entry {
    window_start: Instant,
    suppressed: u64,
    /// The detail of the latest suppressed occurrence, shown in the summary.
    last_detail: String,
}

/// One summary: `count` more warnings of `kind` for `topic` were held back in the last
/// window; `last_detail` is the latest one's detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub topic: String,
    pub kind: &'static str,
    pub count: u64,
    pub last_detail: String,
}

/// Decides which warnings reach the log. Cheap and shared (`&self`).
#[derive(Debug)]
pub struct LogThrottle {
    window: Duration,
    entries: Mutex<HashMap<(String, &'static str), Entry>>,
}

impl Default for LogThrottle {
    fn default() -> Self {
        Self::new(WINDOW)
    }
}

impl LogThrottle {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a warning of `kind` for `topic` should be logged now: the first one of a
    /// window is; the others are counted for [`LogThrottle::summaries`].
    pub fn admit(&self, topic: &str, kind: &'static str, detail: &str) -> bool {
        self.admit_at(Instant::now(), topic, kind, detail)
    }

    fn admit_at(&self, now: Instant, topic: &str, kind: &'static str, detail: &str) -> bool {
        let Ok(mut entries) = self.entries.lock() else {
            return true;
        };
        if let Some(entry) = entries.get_mut(&(topic.to_owned(), kind)) {
            if now.duration_since(entry.window_start) < self.window {
                entry.suppressed += 1;
                entry.last_detail = detail.to_owned();
                return false;
            }
            // A new window; what the old one held back is reported by `summaries`.
            if entry.suppressed == 0 {
                entry.window_start = now;
                return true;
            }
            entry.suppressed += 1;
            entry.last_detail = detail.to_owned();
            return false;
        }
        if entries.len() < MAX_KEYS {
            entries.insert(
                (topic.to_owned(), kind),
                Entry {
                    window_start: now,
                    suppressed: 0,
                    last_detail: String::new(),
                },
            );
        }
        true
    }

    /// The counts held back in windows that have ended, one per key; forgets keys that
    /// were quiet for a whole window. Call it about once per window.
    pub fn summaries(&self) -> Vec<Summary> {
        self.summaries_at(Instant::now(), false)
    }

    /// `all`: also the windows still open (at shutdown, so no count goes unsaid).
    fn summaries_at(&self, now: Instant, all: bool) -> Vec<Summary> {
        let Ok(mut entries) = self.entries.lock() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        entries.retain(|(topic, kind), entry| {
            if !all && now.duration_since(entry.window_start) < self.window {
                return true;
            }
            if entry.suppressed == 0 {
                return false;
            }
            out.push(Summary {
                topic: topic.clone(),
                kind,
                count: entry.suppressed,
                last_detail: std::mem::take(&mut entry.last_detail),
            });
            entry.suppressed = 0;
            entry.window_start = now;
            true
        });
        out.sort_by(|a, b| (&a.topic, a.kind).cmp(&(&b.topic, b.kind)));
        out
    }

    /// Logs the summaries of ended windows as WARN lines; run it every [`WINDOW`].
    pub fn log_summaries(&self) {
        self.log(self.summaries());
    }

    /// Logs every count still held back, windows open or not: at shutdown.
    pub fn log_remaining(&self) {
        self.log(self.summaries_at(Instant::now(), true));
    }

    fn log(&self, summaries: Vec<Summary>) {
        for summary in summaries {
            tracing::warn!(
                topic = %summary.topic,
                count = summary.count,
                last = %summary.last_detail,
                "{} more {} (logged once per {}s per topic; metrics count each)",
                summary.count,
                summary.kind,
                self.window.as_secs()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_is_logged_repeats_are_counted_and_summarised_once_per_window() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(throttle.admit_at(t0, "a", "invalid command", "first"));
        for i in 0..4999 {
            assert!(!throttle.admit_at(
                t0 + Duration::from_millis(i),
                "a",
                "invalid command",
                "again"
            ));
        }
        // Another topic or kind is its own key: its first occurrence is logged too.
        assert!(throttle.admit_at(t0, "b", "invalid command", "x"));
        assert!(throttle.admit_at(t0, "a", "unroutable", "x"));

        assert!(
            throttle
                .summaries_at(t0 + Duration::from_secs(5), false)
                .is_empty(),
            "window still open"
        );
        let summaries = throttle.summaries_at(t0 + Duration::from_secs(10), false);
        assert_eq!(
            summaries,
            vec![Summary {
                topic: "a".into(),
                kind: "invalid command",
                count: 4999,
                last_detail: "again".into(),
            }]
        );
        // Quiet keys are forgotten; the next occurrence is a first one again.
        assert!(throttle
            .summaries_at(t0 + Duration::from_secs(25), false)
            .is_empty());
        assert!(throttle.admit_at(t0 + Duration::from_secs(26), "b", "invalid command", "y"));

        // At shutdown, open windows are reported too.
        assert!(!throttle.admit_at(t0 + Duration::from_secs(27), "b", "invalid command", "z"));
        let remaining = throttle.summaries_at(t0 + Duration::from_secs(28), true);
        assert_eq!(remaining.len(), 1);
        assert_eq!(
            (remaining[0].count, remaining[0].last_detail.as_str()),
            (1, "z")
        );
    }

    #[test]
    fn a_steady_trickle_gives_one_line_per_window_not_one_per_event() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let mut lines = 0;
        for second in 0..60u64 {
            let now = t0 + Duration::from_secs(second);
            if throttle.admit_at(now, "t", "unroutable", "NO_ROUTE") {
                lines += 1;
            }
            lines += throttle.summaries_at(now, false).len();
        }
        assert!(
            (6..=7).contains(&lines),
            "{lines} lines for 60 retries over 60 s"
        );
    }
}

//! What a successful command prints ([`Output`]: its JSON and its text for people), and
//! the text helpers the handlers share.

use std::time::Duration;

use serde_json::Value;

/// What a successful command prints.
#[derive(Debug, Clone)]
pub struct Output {
    pub json: Value,
    pub human: String,
}

impl Output {
    pub fn render(&self, as_json: bool) -> String {
        if as_json {
            // Serializing a `Value` cannot fail.
            serde_json::to_string_pretty(&self.json).unwrap_or_default()
        } else {
            self.human.clone()
        }
    }
}

/// `in 3days 2h`, `12s ago`, `now`: seconds precision is enough for people.
pub(super) fn relative(at: i64, now: i64) -> String {
    let diff = at - now;
    let rounded = Duration::from_secs(diff.unsigned_abs() / 1000);
    if rounded.is_zero() {
        "now".into()
    } else if diff > 0 {
        format!("in {}", humantime::format_duration(rounded))
    } else {
        format!("{} ago", humantime::format_duration(rounded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::rfc3339;

    #[test]
    fn times_read_for_people() {
        assert_eq!(rfc3339(1000), "1970-01-01T00:00:01.000Z");
        assert_eq!(relative(10_500, 0), "in 10s");
        assert_eq!(relative(0, 61_000), "1m 1s ago");
        assert_eq!(relative(400, 0), "now");
    }
}

//! Delivery policies per topic: rate limits, a default job expiry, and the AMQP topic patterns (`*` one
//! word, `#` zero or more words) that say which topics a `[[policies]]` entry covers.
//!
//! A rate limit is enforced in the store (`lua/reserve.lua`), so it holds for the sum
//! of all bridges. The live limit (HTTP, CLI) is stored in Redis and overrides the
//! configuration's policy for its topic; the policy is the default a bridge passes
//! with every reserve call.

use std::fmt;

use serde::Serialize;

use crate::job::Topic;

/// Slowest accepted rate: one job per 1,000 s.
pub const MIN_RATE: f64 = 0.001;
/// Fastest accepted rate; beyond it a limit is a typo, not a limit.
pub const MAX_RATE: f64 = 1_000_000.0;
pub const MAX_BURST: u32 = 1_000_000;

/// The longest accepted expiry (about 31 years): beyond it a value is a typo.
pub const MAX_EXPIRES_AFTER_MS: u64 = 1_000_000_000_000;

/// A bad expiry value, in the user's terms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ExpiryError(pub String);

/// Checks a job expiry in ms after the due time (0 = never), named `name` in errors:
/// the one range rule of the header, REST, the CLI and `[[policies]]`.
pub fn check_expires_after(name: &str, ms: i128) -> Result<u64, ExpiryError> {
    if ms < 0 {
        return Err(ExpiryError(format!(
            "{name} must be >= 0 ms after the due time (0 = never expires), got {ms}"
        )));
    }
    if ms > i128::from(MAX_EXPIRES_AFTER_MS) {
        return Err(ExpiryError(format!(
            "{name} must be at most {MAX_EXPIRES_AFTER_MS} ms, got {ms}"
        )));
    }
    Ok(ms as u64)
}

/// A bad rate or burst, in the user's terms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RateError(pub String);

/// At most `max_per_second` jobs per second on average, `burst` at once after an idle
/// spell: in any window of w seconds at most `burst + max_per_second * w`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RateLimit {
    pub max_per_second: f64,
    pub burst: u32,
}

impl RateLimit {
    /// `burst` defaults to 100 ms worth of jobs (at least 1), which absorbs a
    /// dispatcher's scheduling delays without letting much more than the rate through.
    pub fn new(max_per_second: f64, burst: Option<f64>) -> Result<Self, RateError> {
        if max_per_second.is_nan() || max_per_second.is_infinite() {
            return Err(RateError(format!(
                "max_per_second must be a number of jobs per second, got {max_per_second}"
            )));
        }
        if max_per_second <= 0.0 {
            return Err(RateError(format!(
                "max_per_second must be > 0, got {max_per_second} (to stop delivery, pause the topic)"
            )));
        }
        if !(MIN_RATE..=MAX_RATE).contains(&max_per_second) {
            return Err(RateError(format!(
                "max_per_second must be {MIN_RATE}..={MAX_RATE}, got {max_per_second}"
            )));
        }
        // Six decimals are what the store keeps (it refuses longer numbers).
        let max_per_second = (max_per_second * 1e6).round() / 1e6;
        let burst = match burst {
            None => Self::default_burst(max_per_second),
            Some(b) if b.fract() == 0.0 && (1.0..=f64::from(MAX_BURST)).contains(&b) => b as u32,
            Some(b) => {
                return Err(RateError(format!(
                    "burst must be a whole number 1..={MAX_BURST}, got {b}"
                )))
            }
        };
        Ok(Self {
            max_per_second,
            burst,
        })
    }

    pub fn default_burst(max_per_second: f64) -> u32 {
        (max_per_second / 10.0)
            .ceil()
            .clamp(1.0, f64::from(MAX_BURST)) as u32
    }

    /// The CLI form: `<n>/s` (or a bare number), e.g. `200/s`, `0.5/s`.
    pub fn parse_rate(text: &str) -> Result<f64, RateError> {
        let number = text.trim().strip_suffix("/s").unwrap_or(text.trim());
        number.parse::<f64>().map_err(|_| {
            RateError(format!(
                "rate must be <n>/s with n a number of jobs per second (e.g. 20/s, 0.5/s), got {text:?}"
            ))
        })
    }

    /// The rate as the store takes it: a decimal without exponent, at most 6 decimals.
    pub fn rate_arg(&self) -> String {
        let text = format!("{:.6}", self.max_per_second);
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

impl fmt::Display for RateLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/s, burst {}", self.rate_arg(), self.burst)
    }
}

/// An AMQP topic pattern: dot-separated words, `*` matches one word, `#` zero or more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicPattern {
    words: Vec<String>,
}

impl TopicPattern {
    pub fn new(text: &str) -> Result<Self, String> {
        if text.is_empty() {
            return Err("a topic pattern must not be empty".into());
        }
        let words: Vec<String> = text.split('.').map(str::to_string).collect();
        for word in &words {
            let wild = word == "*" || word == "#";
            if !wild && (word.contains(['*', '#']) || Topic::new(word).is_err()) {
                return Err(format!(
                    "{text:?} is not a topic pattern: each dot-separated word is `*`, `#` or a topic word"
                ));
            }
        }
        Ok(Self { words })
    }

    pub fn matches(&self, topic: &str) -> bool {
        let words: Vec<&str> = topic.split('.').collect();
        matches_words(&self.words, &words)
    }
}

fn matches_words(pattern: &[String], words: &[&str]) -> bool {
    match pattern.split_first() {
        None => words.is_empty(),
        Some((first, rest)) if first == "#" => {
            (0..=words.len()).any(|skip| matches_words(rest, &words[skip..]))
        }
        Some((first, rest)) => match words.split_first() {
            Some((word, more)) => (first == "*" || first == word) && matches_words(rest, more),
            None => false,
        },
    }
}

/// One compiled `[[policies]]` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub topics: Vec<TopicPattern>,
    pub rate: Option<RateLimit>,
    /// Default expiry of the topics' jobs, ms after the due time (0 = never); a job's
    /// own `x-redisched-expires-after` overrides it (see `crate::job::expiry`).
    pub expires_after_ms: u64,
}

/// The configuration's policies, first match wins.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Policies(pub Vec<Policy>);

impl Policies {
    /// The default rate limit of `topic` (the first policy whose patterns match it).
    pub fn rate_for(&self, topic: &Topic) -> Option<RateLimit> {
        self.0
            .iter()
            .find(|policy| policy.topics.iter().any(|p| p.matches(topic.as_str())))
            .and_then(|policy| policy.rate)
    }

    /// The default expiry of `topic`'s jobs, ms (the first policy whose patterns match
    /// it; 0 = never).
    pub fn expires_after_for(&self, topic: &Topic) -> u64 {
        self.0
            .iter()
            .find(|policy| policy.topics.iter().any(|p| p.matches(topic.as_str())))
            .map_or(0, |policy| policy.expires_after_ms)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns_match_like_amqp_topic_bindings() {
        let p = |s| TopicPattern::new(s).unwrap();
        assert!(p("mail.*").matches("mail.welcome"));
        assert!(!p("mail.*").matches("mail.welcome.de"));
        assert!(!p("mail.*").matches("mail"));
        assert!(p("mail.#").matches("mail"));
        assert!(p("mail.#").matches("mail.a.b"));
        assert!(p("#").matches("anything.at.all"));
        assert!(p("#.de").matches("mail.welcome.de"));
        assert!(p("*.welcome.#").matches("mail.welcome"));
        assert!(!p("sms").matches("mail"));
        assert!(TopicPattern::new("").is_err());
        assert!(TopicPattern::new("mail.we*").is_err());
        assert!(TopicPattern::new("mail{x}").is_err());
    }

    #[test]
    fn the_first_matching_policy_wins() {
        let rate = |r| Some(RateLimit::new(r, None).unwrap());
        let policies = Policies(vec![
            Policy {
                topics: vec![TopicPattern::new("mail.bulk").unwrap()],
                rate: rate(1.0),
                expires_after_ms: 0,
            },
            Policy {
                topics: vec![TopicPattern::new("mail.#").unwrap()],
                rate: rate(50.0),
                expires_after_ms: 60_000,
            },
        ]);
        let t = |s| Topic::new(s).unwrap();
        assert_eq!(policies.rate_for(&t("mail.bulk")), rate(1.0));
        assert_eq!(policies.rate_for(&t("mail.welcome")), rate(50.0));
        assert_eq!(policies.rate_for(&t("sms")), None);
        // First match, like the rate: mail.bulk's policy names no expiry.
        assert_eq!(policies.expires_after_for(&t("mail.bulk")), 0);
        assert_eq!(policies.expires_after_for(&t("mail.welcome")), 60_000);
        assert_eq!(policies.expires_after_for(&t("sms")), 0);
    }

    #[test]
    fn bad_rates_are_refused_in_user_terms() {
        for (rate, burst, needle) in [
            (0.0, None, "pause the topic"),
            (-1.0, None, "> 0"),
            (f64::NAN, None, "number"),
            (f64::INFINITY, None, "number"),
            (1e9, None, "0.001..=1000000"),
            (0.0001, None, "0.001..=1000000"),
            (5.0, Some(0.0), "burst"),
            (5.0, Some(1.5), "burst"),
            (5.0, Some(-3.0), "burst"),
        ] {
            let err = RateLimit::new(rate, burst).expect_err("refused");
            assert!(err.0.contains(needle), "{rate} {burst:?}: {err}");
        }
        let half = RateLimit::new(0.5, None).unwrap();
        assert_eq!((half.rate_arg().as_str(), half.burst), ("0.5", 1));
        assert_eq!(RateLimit::new(200.0, None).unwrap().burst, 20);
        assert_eq!(RateLimit::new(200.0, Some(5.0)).unwrap().rate_arg(), "200");
        assert_eq!(RateLimit::parse_rate("20/s"), Ok(20.0));
        assert_eq!(RateLimit::parse_rate("0.5/s"), Ok(0.5));
        assert!(RateLimit::parse_rate("fast").is_err());
    }
}

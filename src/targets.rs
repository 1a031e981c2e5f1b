//! Webhook targets: the `[[targets]]` config schema, which target a topic goes to
//! (AMQP topic patterns, first match wins), and the checks `check-config` and ingest
//! apply (a bad target names its key; a job's own URL must lie under an allowed prefix).
//! Its signing secrets, which may expire: `secret.rs`; its health (circuit breaker,
//! disable and enable): `health.rs`.

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::job::url as job_url;

pub mod health;
mod secret;

pub use health::BreakerConfig;
pub use secret::{secret_key, SigningSecret, EXPIRY_WARNING};

/// One `[[targets]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TargetConfig {
    /// Used in metrics, logs and the API.
    pub name: String,
    /// AMQP topic patterns (`*` one word, `#` any number of words).
    pub topics: Vec<String>,
    pub url: String,
    /// One request, connect to last byte.
    pub timeout_ms: u64,
    /// Concurrent requests to this target, per bridge.
    pub max_in_flight: usize,
    /// The share (0..=1) of `max_in_flight` that retries (attempt > 1) may hold, at
    /// least one slot, and one while first attempts back up; first attempts may use
    /// every slot.
    pub retry_share: f64,
    /// `raw` (the job body verbatim) or `seed` (`{"topic","id","contents"}`).
    pub body: String,
    /// Standard Webhooks secrets (`whsec_` + base64), each a string or a table with an
    /// `expires_at` (RFC 3339); every one listed signs until it expires.
    pub signing_secrets: Vec<SigningSecret>,
    /// Static extra request headers.
    pub headers: BTreeMap<String, String>,
    /// If non-empty, a job may name its own URL when, normalised, it lies under one of
    /// these (same scheme, host and port; whole path segments).
    pub allowed_url_prefixes: Vec<String>,
    /// Lets a job's own URL reach loopback, private, link-local and other non-global
    /// addresses (off: such a URL is refused, a name checked on what it resolves to).
    /// The target's own `url` is the operator's and is never restricted.
    pub allow_private_job_urls: bool,
    /// Send the job's stored AMQP headers as `x-redisched-header-<name>`.
    pub forward_headers: bool,
    /// A PEM file of extra CAs trusted for this target's `https://` URLs.
    pub tls_ca_file: String,
    /// `[targets.breaker]`: when the target's circuit breaker opens.
    pub breaker: BreakerConfig,
}

impl Default for TargetConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            topics: Vec::new(),
            url: String::new(),
            timeout_ms: 10_000,
            max_in_flight: 64,
            retry_share: 0.5,
            body: "raw".into(),
            signing_secrets: Vec::new(),
            headers: BTreeMap::new(),
            allowed_url_prefixes: Vec::new(),
            allow_private_job_urls: false,
            forward_headers: false,
            tls_ca_file: String::new(),
            breaker: BreakerConfig::default(),
        }
    }
}

/// What a webhook request carries as its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    Raw,
    Seed,
}

impl TargetConfig {
    pub fn body_mode(&self) -> BodyMode {
        if self.body == "seed" {
            BodyMode::Seed
        } else {
            BodyMode::Raw
        }
    }

    /// Masks what may be secret, for printing: signing secrets, header values (API
    /// keys), URL passwords.
    pub fn redact(&mut self) {
        for secret in &mut self.signing_secrets {
            *secret = secret.redacted();
        }
        for value in self.headers.values_mut() {
            *value = "***".into();
        }
        self.url = crate::urls::redact_url(&self.url);
    }

    /// The HMAC keys that sign a request sent at `at`: those of the secrets that have
    /// not expired by then, in the order listed (none: the request goes unsigned).
    pub fn signing_keys_at(&self, at: SystemTime) -> Vec<Vec<u8>> {
        secret::keys_at(&self.signing_secrets, at)
    }

    /// Whether any of this target's patterns matches `topic`.
    pub fn serves(&self, topic: &str) -> bool {
        self.topics.iter().any(|p| pattern_matches(p, topic))
    }

    /// The SSRF guard: a job may name its own URL only when, parsed and normalised as
    /// the HTTP client will request it, it lies under an allowed prefix, and (unless
    /// `allow_private_job_urls`) its host is not a forbidden literal address. `Ok` is
    /// exactly the URL to request; a name's addresses are checked at connect time.
    pub fn check_job_url(&self, raw: &str) -> Result<url::Url, String> {
        if self.allowed_url_prefixes.is_empty() {
            return Err(format!(
                "target {} allows no per-job URL (its allowed_url_prefixes is empty)",
                self.name
            ));
        }
        let url = job_url::parse(raw)?;
        let under = self
            .allowed_url_prefixes
            .iter()
            .filter_map(|prefix| job_url::parse(prefix).ok())
            .any(|prefix| job_url::under_prefix(&url, &prefix));
        if !under {
            return Err(format!(
                "URL {raw:?} (requested as {}) is not under any of target {}'s allowed_url_prefixes",
                url.as_str(),
                self.name
            ));
        }
        if !self.allow_private_job_urls {
            if let Some((ip, why)) = job_url::forbidden_host(&url) {
                return Err(format!(
                    "URL {raw:?} names {ip}, {why}; target {} does not set allow_private_job_urls",
                    self.name
                ));
            }
        }
        Ok(url)
    }
}

/// The target serving `topic`: the first whose patterns match, with its index.
pub fn target_for<'a>(
    targets: &'a [TargetConfig],
    topic: &str,
) -> Option<(usize, &'a TargetConfig)> {
    targets.iter().enumerate().find(|(_, t)| t.serves(topic))
}

/// The topics of `topics` that the target named `name` serves (it is their first match).
pub fn served_by<'a>(
    targets: &[TargetConfig],
    name: &str,
    topics: &'a [crate::job::Topic],
) -> Vec<&'a crate::job::Topic> {
    topics
        .iter()
        .filter(|topic| target_for(targets, topic.as_str()).is_some_and(|(_, t)| t.name == name))
        .collect()
}

/// The SSRF guard for a job naming its own URL (AMQP `x-redisched-url`, REST and CLI
/// `url`): its topic's target must allow it.
pub fn check_job_url_for(targets: &[TargetConfig], topic: &str, url: &str) -> Result<(), String> {
    match target_for(targets, topic) {
        None => Err(format!(
            "a job URL was given, but no webhook target serves topic {topic}"
        )),
        Some((_, target)) => target.check_job_url(url).map(|_| ()),
    }
}

/// AMQP topic matching: words split on `.`, `*` matches one word, `#` zero or more.
pub fn pattern_matches(pattern: &str, topic: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let t: Vec<&str> = topic.split('.').collect();
    words_match(&p, &t)
}

fn words_match(p: &[&str], t: &[&str]) -> bool {
    match p.split_first() {
        None => t.is_empty(),
        Some((&"#", rest)) => (0..=t.len()).any(|skip| words_match(rest, &t[skip..])),
        Some((word, rest)) => match t.split_first() {
            Some((first, tail)) => (*word == "*" || word == first) && words_match(rest, tail),
            None => false,
        },
    }
}

/// Whether pattern `a` matches every topic pattern `b` matches (so `b`, listed after
/// `a`, can never be the first match).
pub fn pattern_covers(a: &str, b: &str) -> bool {
    let a: Vec<&str> = a.split('.').collect();
    let b: Vec<&str> = b.split('.').collect();
    covers(&a, &b)
}

fn covers(a: &[&str], b: &[&str]) -> bool {
    match (a.split_first(), b.split_first()) {
        (None, None) => true,
        (None, Some(_)) => false,
        (Some((&"#", rest)), _) => covers(rest, b) || (!b.is_empty() && covers(a, &b[1..])),
        (Some(_), None) => false,
        // `#` in b may stand for zero or several words: only a `#` in a covers it.
        (Some(_), Some((&"#", _))) => false,
        (Some((&"*", ra)), Some((_, rb))) => covers(ra, rb),
        (Some((wa, ra)), Some((wb, rb))) => wa == wb && covers(ra, rb),
    }
}

/// A bad `[[targets]]` entry: the key (`targets[1].url`) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetError {
    pub key: String,
    pub message: String,
}

fn bad(i: usize, field: &str, message: impl Into<String>) -> TargetError {
    TargetError {
        key: format!("targets[{i}].{field}"),
        message: message.into(),
    }
}

/// Checks every target; `ttr_ms` is `dispatch.ttr_ms` (a request must end within it,
/// or the job would be requeued while still in flight).
pub fn validate(targets: &[TargetConfig], ttr_ms: u64) -> Result<(), TargetError> {
    let mut names = std::collections::HashSet::new();
    let mut earlier: Vec<(usize, &str)> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        if t.name.is_empty()
            || !t
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(bad(
                i,
                "name",
                "must be non-empty: letters, digits, `-`, `_`, `.`",
            ));
        }
        if !names.insert(t.name.as_str()) {
            return Err(bad(i, "name", format!("{:?} names two targets", t.name)));
        }
        if t.topics.is_empty() {
            return Err(bad(i, "topics", "must list at least one topic pattern"));
        }
        for (j, pattern) in t.topics.iter().enumerate() {
            if pattern.is_empty() || pattern.split('.').any(str::is_empty) {
                return Err(bad(
                    i,
                    &format!("topics[{j}]"),
                    format!("{pattern:?} is not a topic pattern (dot-separated words, `*`, `#`)"),
                ));
            }
            if let Some((k, _)) = earlier.iter().find(|(_, e)| pattern_covers(e, pattern)) {
                return Err(bad(
                    i,
                    &format!("topics[{j}]"),
                    format!(
                        "{pattern:?} can never match: target {} lists a pattern before it that matches every such topic (first match wins)",
                        targets[*k].name
                    ),
                ));
            }
        }
        for pattern in &t.topics {
            earlier.push((i, pattern));
        }
        check_delivery(i, t, ttr_ms)?;
    }
    Ok(())
}

/// The checks of one target's delivery settings (`i`: its index, for the error): URLs,
/// timeout against the TTR, slots, body mode, secrets, headers, CA file.
fn check_delivery(i: usize, t: &TargetConfig, ttr_ms: u64) -> Result<(), TargetError> {
    check_http_url(&t.url).map_err(|m| bad(i, "url", m))?;
    t.breaker
        .check()
        .map_err(|(key, m)| bad(i, &format!("breaker.{key}"), m))?;
    for (j, prefix) in t.allowed_url_prefixes.iter().enumerate() {
        let key = format!("allowed_url_prefixes[{j}]");
        check_http_url(prefix).map_err(|m| bad(i, &key, m))?;
        let parsed = job_url::parse(prefix).map_err(|m| bad(i, &key, m))?;
        // A prefix is whole path segments: without the slash `/peruser` would read as
        // admitting `/peruserx`; a query would be compared with nothing.
        if !prefix.ends_with('/') || parsed.query().is_some() {
            return Err(bad(
                i,
                &key,
                format!("{prefix:?} must end with `/` (and have no query)"),
            ));
        }
    }
    if t.timeout_ms == 0 {
        return Err(bad(i, "timeout_ms", "must be > 0"));
    }
    if t.timeout_ms >= ttr_ms {
        return Err(bad(
            i,
            "timeout_ms",
            format!("must be below dispatch.ttr_ms ({ttr_ms} ms): a request still running at the time-to-run is delivered twice"),
        ));
    }
    if t.max_in_flight == 0 {
        return Err(bad(i, "max_in_flight", "must be > 0"));
    }
    if !(0.0..=1.0).contains(&t.retry_share) {
        return Err(bad(
            i,
            "retry_share",
            format!(
                "{}: must be a number from 0 to 1 (the share of max_in_flight retries may hold)",
                t.retry_share
            ),
        ));
    }
    if !matches!(t.body.as_str(), "raw" | "seed") {
        return Err(bad(
            i,
            "body",
            format!("{:?}: must be `raw` or `seed`", t.body),
        ));
    }
    for (j, secret) in t.signing_secrets.iter().enumerate() {
        secret
            .check()
            .map_err(|(tail, m)| bad(i, &format!("signing_secrets[{j}]{tail}"), m))?;
    }
    for (name, value) in &t.headers {
        if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err()
            || reqwest::header::HeaderValue::from_str(value).is_err()
        {
            return Err(bad(
                i,
                &format!("headers.{name}"),
                "not a valid HTTP header name and value",
            ));
        }
    }
    if !t.tls_ca_file.is_empty() && !std::path::Path::new(&t.tls_ca_file).is_file() {
        return Err(bad(
            i,
            "tls_ca_file",
            format!("{} is not a readable file", t.tls_ca_file),
        ));
    }
    Ok(())
}

fn check_http_url(raw: &str) -> Result<(), String> {
    let url = url::Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL ({e})"))?;
    match url.scheme() {
        "http" => {}
        "https" if crate::tls::ENABLED => {}
        "https" => {
            return Err(
                "https:// needs TLS, and this build has none (built without the `tls` feature)"
                    .into(),
            )
        }
        other => return Err(format!("scheme {other}:// is not http:// or https://")),
    }
    if !url.has_host() {
        return Err(format!("{raw:?} names no host"));
    }
    Ok(())
}

/// What `check-config` warns of at `now`: signing secrets that have expired or expire
/// within [`EXPIRY_WARNING`], each named by target and key.
pub fn secret_warnings(targets: &[TargetConfig], now: SystemTime) -> Vec<String> {
    targets
        .iter()
        .enumerate()
        .flat_map(|(i, t)| secret::expiry_warnings(i, &t.name, &t.signing_secrets, now))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns_match_as_amqp_does() {
        assert!(pattern_matches("billing", "billing"));
        assert!(!pattern_matches("billing", "billing.eu"));
        assert!(pattern_matches("billing.#", "billing"));
        assert!(pattern_matches("billing.#", "billing.eu.de"));
        assert!(pattern_matches("*.eu", "billing.eu"));
        assert!(!pattern_matches("*.eu", "eu"));
        assert!(pattern_matches("#", "anything.at.all"));
        assert!(pattern_matches("a.#.z", "a.z"));
        assert!(pattern_matches("a.#.z", "a.b.c.z"));
        assert!(!pattern_matches("a.#.z", "a.b.c"));
    }

    #[test]
    fn a_pattern_covered_by_an_earlier_one_is_found() {
        assert!(pattern_covers("#", "billing.eu"));
        assert!(pattern_covers("billing.#", "billing.*"));
        assert!(pattern_covers("billing.#", "billing"));
        assert!(pattern_covers("*.eu", "billing.eu"));
        assert!(pattern_covers("billing", "billing"));
        assert!(!pattern_covers("billing.*", "billing.#"));
        assert!(!pattern_covers("billing", "billing.eu"));
        assert!(!pattern_covers("*", "#"));
        assert!(!pattern_covers("a.*", "b.*"));
    }

    fn target(name: &str, topics: &[&str]) -> TargetConfig {
        TargetConfig {
            name: name.into(),
            topics: topics.iter().map(|s| s.to_string()).collect(),
            url: "http://127.0.0.1:9191/receive".into(),
            ..TargetConfig::default()
        }
    }

    #[test]
    fn validation_names_the_key() {
        let key = |targets: &[TargetConfig]| validate(targets, 30_000).err().map(|e| e.key);
        assert_eq!(key(&[target("a", &["billing.#"])]), None);
        assert_eq!(
            key(&[target("a", &["billing.#"]), target("b", &["billing.eu"])]).as_deref(),
            Some("targets[1].topics[0]")
        );
        let mut t = target("a", &["x"]);
        t.url = "ftp://h/".into();
        assert_eq!(key(&[t]).as_deref(), Some("targets[0].url"));
        let mut t = target("a", &["x"]);
        t.body = "json".into();
        assert_eq!(key(&[t]).as_deref(), Some("targets[0].body"));
        let mut t = target("a", &["x"]);
        t.signing_secrets = vec![
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
            "nope".into(),
        ];
        assert_eq!(key(&[t]).as_deref(), Some("targets[0].signing_secrets[1]"));
        let mut t = target("a", &["x"]);
        t.max_in_flight = 0;
        assert_eq!(key(&[t]).as_deref(), Some("targets[0].max_in_flight"));
        for share in [-0.1, 1.5, f64::NAN] {
            let mut t = target("a", &["x"]);
            t.retry_share = share;
            assert_eq!(key(&[t]).as_deref(), Some("targets[0].retry_share"));
        }
        for share in [0.0, 0.25, 1.0] {
            let mut t = target("a", &["x"]);
            t.retry_share = share;
            assert_eq!(key(&[t]), None);
        }
        let mut t = target("a", &["x"]);
        t.timeout_ms = 0;
        assert_eq!(key(&[t]).as_deref(), Some("targets[0].timeout_ms"));
        let mut t = target("a", &["x"]);
        t.timeout_ms = 30_000;
        assert_eq!(key(&[t]).as_deref(), Some("targets[0].timeout_ms"));
        assert_eq!(
            key(&[target("a", &["x"]), target("a", &["y"])]).as_deref(),
            Some("targets[1].name")
        );
    }

    #[test]
    fn a_job_url_must_lie_under_an_allowed_prefix() {
        let mut t = target("a", &["x"]);
        assert!(t.check_job_url("http://127.0.0.1:1/x").is_err());
        t.allowed_url_prefixes = vec!["https://hooks.example.com/".into()];
        assert!(t.check_job_url("https://hooks.example.com/a").is_ok());
        assert!(t
            .check_job_url("https://hooks.example.com.evil.org/a")
            .is_err());
        assert!(t.check_job_url("http://169.254.169.254/").is_err());
    }

    #[test]
    fn a_literal_private_address_needs_allow_private_job_urls() {
        let mut t = target("a", &["x"]);
        t.allowed_url_prefixes = vec!["http://127.0.0.1:9191/own/".into()];
        let err = t.check_job_url("http://127.0.0.1:9191/own/a").unwrap_err();
        assert!(err.contains("a loopback address"), "{err}");
        assert!(err.contains("allow_private_job_urls"), "{err}");
        t.allow_private_job_urls = true;
        let url = t
            .check_job_url("http://127.0.0.1:9191/own/./a")
            .expect("allowed");
        assert_eq!(url.as_str(), "http://127.0.0.1:9191/own/a");
        let err = t
            .check_job_url("http://127.0.0.1:9191/own/../evil")
            .unwrap_err();
        assert!(
            err.contains("requested as http://127.0.0.1:9191/evil"),
            "{err}"
        );
    }

    #[test]
    fn a_prefix_must_end_with_a_slash_and_have_no_query() {
        let key = |prefix: &str| {
            let mut t = target("a", &["x"]);
            t.allowed_url_prefixes = vec![prefix.into()];
            validate(&[t], 30_000).err().map(|e| e.key)
        };
        assert_eq!(key("https://h.example/own/"), None);
        for bad in [
            "https://h.example/own",
            "https://h.example/own/?a=1",
            "https://u@h.example/own/",
        ] {
            assert_eq!(
                key(bad).as_deref(),
                Some("targets[0].allowed_url_prefixes[0]"),
                "{bad}"
            );
        }
    }
}

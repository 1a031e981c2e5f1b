//! The plain HTTP client of the webhook figures, built as the bridge builds a target's,
//! and the headers the bridge sends: shared by the ceiling and the relay
//! (`webhook.rs`) and the bookkeeping floor (`webhook_floor.rs`), so neither imports
//! the other.

use std::time::Duration;

use anyhow::{Context, Result};
use axum::http::HeaderMap;
use redisched::job::headers;

use super::common;

/// The ceiling's client: as the bridge builds a target's (no redirects, pooled keep-alive).
pub(super) fn plain_client(max_in_flight: usize, timeout_ms: u64) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_millis(timeout_ms))
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(max_in_flight)
        .build()
        .context("build the plain HTTP client")
}

/// The headers the bridge sends with a raw body and no secrets, same names and sizes,
/// and `extra` ones (the bench's own, valid names).
pub(super) fn like_the_bridge(n: u64, extra: &[(&str, String)]) -> HeaderMap {
    let now_ms = common::now_us() / 1000;
    let fields = [
        ("content-type", "application/octet-stream".to_string()),
        (headers::TOPIC, "hook".to_string()),
        (headers::ID, common::job_id("job", n)),
        (headers::DUE_AT, now_ms.to_string()),
        (headers::ATTEMPT, "1".to_string()),
        ("webhook-id", format!("msg_{n:032x}")),
        ("webhook-timestamp", (now_ms / 1000).to_string()),
    ];
    let mut map = HeaderMap::new();
    for (name, value) in fields.iter().chain(extra.iter()) {
        if let (Ok(name), Ok(value)) = (
            reqwest::header::HeaderName::from_bytes(name.as_bytes()),
            reqwest::header::HeaderValue::from_str(value),
        ) {
            map.insert(name, value);
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_sends_the_headers_the_bridge_sends() {
        let map = like_the_bridge(7, &[("x-extra", "1".into())]);
        for name in [
            "content-type",
            headers::TOPIC,
            headers::ID,
            headers::DUE_AT,
            headers::ATTEMPT,
            "webhook-id",
            "webhook-timestamp",
            "x-extra",
        ] {
            assert!(map.contains_key(name), "{name} missing");
        }
        assert_eq!(map[headers::ID], common::job_id("job", 7).as_str());
    }
}

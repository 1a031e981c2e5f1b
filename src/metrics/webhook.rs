//! The webhook targets' metrics (requests by outcome code, their duration) and the live
//! state of each target that `GET /v1/targets` shows; the breaker's state per target
//! (`redisched_webhook_target_state`) and its changes
//! (`redisched_webhook_target_transitions_total`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabels {
    pub target: String,
    /// `2xx`, `4xx`, `5xx`, `timeout`, `connect`, `tls` (rarer: `1xx`, `3xx`, `url`, `error`).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    pub target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetStateLabels {
    pub target: String,
    /// `closed`, `open`, `half_open`, `disabled`.
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub target: String,
    /// `open`, `half_open`, `closed`, `disabled`, `enabled`.
    pub to: String,
}

/// A webhook target's live state, as `GET /v1/targets` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TargetStatus {
    pub in_flight: u64,
    pub delivered: u64,
    pub failures: u64,
    /// Failures since the last 2xx: a failing target stands out.
    pub consecutive_failures: u64,
    /// `200`, `503`, `timeout`, ... of the latest attempt.
    pub last_status: Option<String>,
    pub last_error: Option<String>,
}

fn webhook_seconds() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

/// The outcome codes a request can end with: each target's counter of one is created
/// at its first use, then reused.
const CODES: [&str; 10] = [
    "2xx", "4xx", "5xx", "timeout", "connect", "tls", "1xx", "3xx", "url", "error",
];

/// The webhook targets' metrics and live state.
#[derive(Debug)]
pub struct WebhookMetrics {
    pub requests: Family<WebhookLabels, Counter>,
    pub seconds: Family<TargetLabels, Histogram, fn() -> Histogram>,
    pub target_state: Family<TargetStateLabels, Gauge>,
    pub transitions: Family<TransitionLabels, Counter>,
    targets: Mutex<BTreeMap<String, Arc<TargetMeter>>>,
}

/// One target's metrics: its series taken from the families once (a series appears at
/// its first observation, as before), so a request builds no labels, hashes none and
/// takes no lock but its target's status.
#[derive(Debug)]
pub struct TargetMeter {
    target: String,
    requests: Family<WebhookLabels, Counter>,
    seconds_family: Family<TargetLabels, Histogram, fn() -> Histogram>,
    /// One per [`CODES`] entry, in that order.
    counters: [OnceLock<Counter>; CODES.len()],
    seconds: OnceLock<Histogram>,
    status: Mutex<TargetStatus>,
}

impl TargetMeter {
    fn status(&self) -> std::sync::MutexGuard<'_, TargetStatus> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn labels(&self, code: &str) -> WebhookLabels {
        WebhookLabels {
            target: self.target.clone(),
            code: code.into(),
        }
    }

    /// A request starts.
    pub fn started(&self) {
        self.status().in_flight += 1;
    }

    /// A request ended with `code` (`2xx`, `timeout`, ...); `status` the HTTP status
    /// or the code; `error` the failure's text.
    pub fn finished(&self, code: &str, status: &str, error: Option<String>, seconds: f64) {
        match CODES.iter().position(|c| *c == code) {
            Some(i) => self.counters[i]
                .get_or_init(|| self.requests.get_or_create(&self.labels(code)).clone())
                .inc(),
            None => self.requests.get_or_create(&self.labels(code)).inc(),
        };
        self.seconds
            .get_or_init(|| {
                self.seconds_family
                    .get_or_create(&TargetLabels {
                        target: self.target.clone(),
                    })
                    .clone()
            })
            .observe(seconds);
        let mut s = self.status();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.last_status.as_deref() != Some(status) {
            s.last_status = Some(status.to_owned());
        }
        if error.is_some() {
            s.failures += 1;
            s.consecutive_failures += 1;
            s.last_error = error;
        } else {
            s.delivered += 1;
            s.consecutive_failures = 0;
        }
    }
}

impl WebhookMetrics {
    pub(super) fn new(registry: &mut Registry) -> Self {
        let requests = Family::<WebhookLabels, Counter>::default();
        let seconds = Family::<TargetLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            webhook_seconds,
        );
        registry.register(
            "webhook_requests",
            "Webhook requests, by target and outcome code",
            requests.clone(),
        );
        registry.register(
            "webhook_request_seconds",
            "Webhook request duration, connect to last byte, by target",
            seconds.clone(),
        );
        let target_state = Family::<TargetStateLabels, Gauge>::default();
        let transitions = Family::<TransitionLabels, Counter>::default();
        registry.register(
            "webhook_target_state",
            "A webhook target's breaker state: 1 for the current one, 0 for the others",
            target_state.clone(),
        );
        registry.register(
            "webhook_target_transitions",
            "Changes of a webhook target's state made by this bridge, by the state changed to",
            transitions.clone(),
        );
        Self {
            requests,
            seconds,
            target_state,
            transitions,
            targets: Mutex::new(BTreeMap::new()),
        }
    }

    /// The metrics of `target`, made at its first call; keep it rather than calling again
    /// per request.
    pub fn meter(&self, target: &str) -> Arc<TargetMeter> {
        let mut targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(meter) = targets.get(target) {
            return meter.clone();
        }
        let meter = Arc::new(TargetMeter {
            target: target.to_owned(),
            requests: self.requests.clone(),
            seconds_family: self.seconds.clone(),
            counters: Default::default(),
            seconds: OnceLock::new(),
            status: Mutex::default(),
        });
        targets.insert(target.to_owned(), meter.clone());
        meter
    }

    /// A request starts.
    pub fn started(&self, target: &str) {
        self.meter(target).started();
    }

    /// A request ended with `code` (`2xx`, `timeout`, ...); `status` the HTTP status
    /// or the code; `error` the failure's text.
    pub fn finished(
        &self,
        target: &str,
        code: &str,
        status: String,
        error: Option<String>,
        seconds: f64,
    ) {
        self.meter(target).finished(code, &status, error, seconds);
    }

    /// `state` is `target`'s current one (of `states`, every state's name): 1 for it,
    /// 0 for the others.
    pub fn set_target_state(&self, target: &str, state: &str, states: &[&str]) {
        for s in states {
            let labels = TargetStateLabels {
                target: target.to_owned(),
                state: (*s).to_owned(),
            };
            self.target_state
                .get_or_create(&labels)
                .set(i64::from(*s == state));
        }
    }

    /// One change of `target`'s state, to `to`.
    pub fn target_transition(&self, target: &str, to: &str) {
        let labels = TransitionLabels {
            target: target.to_owned(),
            to: to.to_owned(),
        };
        self.transitions.get_or_create(&labels).inc();
    }

    pub fn status(&self, target: &str) -> TargetStatus {
        let targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        targets
            .get(target)
            .map(|meter| meter.status().clone())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).unwrap_or_default();
        out
    }

    #[test]
    fn a_meter_counts_into_the_series_of_its_target_and_code() {
        let mut registry = Registry::default();
        let metrics = WebhookMetrics::new(&mut registry);
        let a = metrics.meter("a");
        assert!(Arc::ptr_eq(&a, &metrics.meter("a")), "one meter per target");
        for _ in 0..2 {
            a.started();
            a.finished("2xx", "200", None, 0.01);
        }
        a.started();
        a.finished("5xx", "503", Some("HTTP 503".into()), 0.02);
        // A code outside the known list still counts, in its own series.
        metrics.finished("b", "other", "other".into(), Some("?".into()), 0.5);
        let count = |target: &str, code: &str| {
            metrics
                .requests
                .get_or_create(&WebhookLabels {
                    target: target.into(),
                    code: code.into(),
                })
                .get()
        };
        assert_eq!((count("a", "2xx"), count("a", "5xx")), (2, 1));
        assert_eq!(count("b", "other"), 1);
        let out = text(&registry);
        assert!(
            out.contains("webhook_request_seconds_count{target=\"a\"} 3"),
            "{out}"
        );
        assert!(
            out.contains("webhook_request_seconds_count{target=\"b\"} 1"),
            "{out}"
        );
        // No series for a code that never happened.
        assert!(!out.contains("code=\"4xx\""), "{out}");
        let status = metrics.status("a");
        assert_eq!(
            (status.in_flight, status.delivered, status.failures),
            (0, 2, 1)
        );
        assert_eq!(status.consecutive_failures, 1);
        assert_eq!(status.last_status.as_deref(), Some("503"));
        assert_eq!(status.last_error.as_deref(), Some("HTTP 503"));
        assert_eq!(metrics.status("never"), TargetStatus::default());
    }
}

//! The webhook targets' metrics (requests by outcome code, their duration) and the live
//! state of each target that `GET /v1/targets` shows.

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
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

/// The webhook targets' metrics and live state.
#[derive(Debug)]
pub struct WebhookMetrics {
    pub requests: Family<WebhookLabels, Counter>,
    pub seconds: Family<TargetLabels, Histogram, fn() -> Histogram>,
    targets: Mutex<BTreeMap<String, TargetStatus>>,
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
        Self {
            requests,
            seconds,
            targets: Mutex::new(BTreeMap::new()),
        }
    }

    fn with_status(&self, target: &str, change: impl FnOnce(&mut TargetStatus)) {
        let mut targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        change(targets.entry(target.to_owned()).or_default());
    }

    /// A request starts.
    pub fn started(&self, target: &str) {
        self.with_status(target, |s| s.in_flight += 1);
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
        self.requests
            .get_or_create(&WebhookLabels {
                target: target.into(),
                code: code.into(),
            })
            .inc();
        self.seconds
            .get_or_create(&TargetLabels {
                target: target.into(),
            })
            .observe(seconds);
        self.with_status(target, |s| {
            s.in_flight = s.in_flight.saturating_sub(1);
            s.last_status = Some(status);
            if error.is_some() {
                s.failures += 1;
                s.consecutive_failures += 1;
                s.last_error = error;
            } else {
                s.delivered += 1;
                s.consecutive_failures = 0;
            }
        });
    }

    pub fn status(&self, target: &str) -> TargetStatus {
        let targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        targets.get(target).cloned().unwrap_or_default()
    }
}

//! Whether a topic's jobs wait on its webhook target's breaker: `held_by` of each row of
//! `GET /v1/topics` and `redisched stats --json`, and the `HELD BY` column of `redisched
//! stats`. The per-target view of the same state is `TargetHealthFields` (`GET
//! /v1/targets`); these fields keep its names.

use serde::Serialize;

use crate::store::TargetHealth;
use crate::targets::health::State;
use crate::targets::{target_for, TargetConfig};

/// The target whose breaker holds a topic's jobs: they wait, scheduled, spending no
/// attempts (`half_open` lets one probe request through).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeldBy {
    pub target: String,
    /// `open`, `half_open` or `disabled`; never `closed` (then `held_by` is `null`).
    pub state: State,
    /// Why the state last changed; `null` when no reason was recorded.
    pub state_reason: Option<String>,
}

impl HeldBy {
    /// For `topic`: `None` when no target serves it (the first target whose patterns
    /// match does), when that target is closed, or when `health` lacks it.
    pub fn of(
        targets: &[TargetConfig],
        health: &[(String, TargetHealth)],
        topic: &str,
    ) -> Option<Self> {
        let (_, target) = target_for(targets, topic)?;
        let (_, h) = health.iter().find(|(name, _)| *name == target.name)?;
        h.state.holds().then(|| Self {
            target: target.name.clone(),
            state: h.state,
            state_reason: (!h.reason.is_empty()).then(|| h.reason.clone()),
        })
    }

    /// For people: `billing (open)`, or `-` when nothing holds the topic.
    pub fn describe(held: Option<&Self>) -> String {
        held.map_or_else(
            || "-".to_owned(),
            |h| format!("{} ({})", h.target, h.state.as_str()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(name: &str, pattern: &str) -> TargetConfig {
        TargetConfig {
            name: name.into(),
            topics: vec![pattern.into()],
            url: "http://127.0.0.1:9/hook".into(),
            ..TargetConfig::default()
        }
    }

    fn health(state: State, reason: &str) -> TargetHealth {
        TargetHealth {
            state,
            claimed: false,
            reason: reason.into(),
            changed_at: 0,
            requests: 0,
            failures: 0,
            trips: 0,
            opened_at: 0,
            now: 0,
            changes: Vec::new(),
        }
    }

    #[test]
    fn the_first_matching_target_holds_unless_it_is_closed() {
        let targets = [target("billing", "billing.#"), target("all", "#")];
        let health = [
            ("billing".to_owned(), health(State::Open, "5 of 10 failed")),
            ("all".to_owned(), health(State::Closed, "")),
        ];
        let held = HeldBy::of(&targets, &health, "billing.eu").expect("held");
        assert_eq!(
            serde_json::to_value(&held).unwrap(),
            serde_json::json!({"target": "billing", "state": "open", "state_reason": "5 of 10 failed"})
        );
        assert_eq!(HeldBy::describe(Some(&held)), "billing (open)");
        assert_eq!(HeldBy::of(&targets, &health, "mail"), None, "closed");
        assert_eq!(HeldBy::of(&[], &health, "billing.eu"), None, "no target");
        assert_eq!(HeldBy::of(&targets, &[], "billing.eu"), None, "no health");
        assert_eq!(HeldBy::describe(None), "-");
    }

    #[test]
    fn half_open_and_disabled_hold_and_an_empty_reason_is_null() {
        let targets = [target("billing", "billing.#")];
        for state in [State::HalfOpen, State::Disabled] {
            let health = [("billing".to_owned(), health(state, ""))];
            let held = HeldBy::of(&targets, &health, "billing.eu").expect("held");
            assert_eq!((held.state, held.state_reason), (state, None));
        }
        let json = serde_json::to_value(HeldBy {
            target: "b".into(),
            state: State::HalfOpen,
            state_reason: None,
        })
        .unwrap();
        assert_eq!(json["state"], "half_open");
        assert!(json["state_reason"].is_null(), "{json}");
    }
}

//! The answer to a re-drive by target and time window (`POST /v1/targets/{name}/redrive`,
//! `redisched targets redrive <name> --json`).

use serde::Serialize;

use super::rfc3339;
use crate::job::window::FailureWindow;
use crate::job::Topic;

/// How many parked jobs were made due now, in all and per topic the target serves.
#[derive(Debug, Clone, Serialize)]
pub struct TargetRedriveView {
    pub target: String,
    /// The window the last failures were taken from, epoch ms, both ends included.
    pub since: i64,
    pub since_rfc3339: String,
    pub until: i64,
    pub until_rfc3339: String,
    pub redriven: u64,
    /// Every known topic the target serves (the first target whose patterns match a
    /// topic serves it), by name, with what was re-driven in it (0 included).
    pub topics: Vec<TopicRedriven>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopicRedriven {
    pub topic: Topic,
    pub redriven: u64,
}

impl TargetRedriveView {
    pub fn new(target: &str, window: FailureWindow, moved: &[(Topic, u64)]) -> Self {
        Self {
            target: target.to_string(),
            since: window.since,
            since_rfc3339: rfc3339(window.since),
            until: window.until,
            until_rfc3339: rfc3339(window.until),
            redriven: moved.iter().map(|(_, n)| n).sum(),
            topics: moved
                .iter()
                .map(|(topic, n)| TopicRedriven {
                    topic: topic.clone(),
                    redriven: *n,
                })
                .collect(),
        }
    }
}

/// The "not found" text of both faces for a target name: the configured ones, so a
/// typo shows.
pub fn no_such_target(name: &str, targets: &[crate::targets::TargetConfig]) -> String {
    let names: Vec<&str> = targets.iter().map(|t| t.name.as_str()).collect();
    if names.is_empty() {
        format!("no webhook target named {name:?}: the configuration has no [[targets]]")
    } else {
        format!(
            "no webhook target named {name:?} (configured: {})",
            names.join(", ")
        )
    }
}

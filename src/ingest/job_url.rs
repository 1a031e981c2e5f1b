//! The SSRF guard at the door: a command naming its own URL (`x-redisched-url`) is
//! valid only for a topic a webhook target serves, and only under one of that target's
//! `allowed_url_prefixes`. Anything else is set aside with the reason, as every invalid
//! command is.

use crate::job::Topic;
use crate::targets::{check_job_url_for, TargetConfig};

/// Checks the URL a put of `topic` names for itself; `Err` with the reason.
pub(super) fn check(topic: &Topic, url: &str, targets: &[TargetConfig]) -> Result<(), String> {
    check_job_url_for(targets, topic.as_str(), url)
}

//! Path and query values every REST handler parses the same way: topics, ids, counts,
//! the job-list state. One place, so the handlers' modules need not import each other.

use super::ApiError;
use crate::job::{JobId, Topic};
use crate::store::ListWhich;

pub(super) fn parse_topic(raw: &str) -> Result<Topic, ApiError> {
    Topic::new(raw).map_err(|e| ApiError::bad_request(format!("bad topic: {e}")))
}

pub(super) fn parse_id(raw: &str) -> Result<JobId, ApiError> {
    JobId::new(raw).map_err(|e| ApiError::bad_request(format!("bad job id: {e}")))
}

/// A non-negative integer written as ASCII digits only (no sign, no spaces); `None`
/// for anything else, including the empty string.
pub(super) fn parse_count(raw: &str) -> Option<u64> {
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(raw.parse::<u64>().unwrap_or(u64::MAX))
}

/// The `state` query parameter of `GET /v1/topics/{topic}/jobs`: `scheduled` (default)
/// or `parked`.
pub(super) fn list_which(raw: Option<&str>) -> Result<ListWhich, ApiError> {
    match raw {
        None | Some("scheduled") => Ok(ListWhich::Scheduled),
        Some("parked") => Ok(ListWhich::Parked),
        Some(other) => Err(ApiError::bad_request(format!(
            "state must be `scheduled` or `parked`, got {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn list_states_parse() {
        assert_eq!(list_which(None).ok(), Some(ListWhich::Scheduled));
        assert_eq!(list_which(Some("parked")).ok(), Some(ListWhich::Parked));
        let err = list_which(Some("dead")).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.message.contains("`parked`"), "{}", err.message);
        assert!(list_which(Some("")).is_err(), "an empty value is refused");
    }
}

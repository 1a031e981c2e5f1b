//! `lua/retry.lua`: handing a reserved job back, due again after a delay, token-fenced;
//! after a failed delivery with its reason recorded, and parked once its failures reach
//! `max_attempts`.

use std::time::Duration;

use serde::Serialize;

use crate::store::scripts::Scripts;
use crate::store::types::Lease;
use crate::store::{Store, StoreError};

/// Longest failure reason `retry.lua` stores; longer ones are cut here, not refused.
const MAX_ERROR_BYTES: usize = 256;

/// What `Store::retry_failed` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryOutcome {
    /// Due again after the delay.
    Retried,
    /// Its failures reached `max_attempts`: parked until re-driven.
    Parked,
    /// No longer ours (released, replaced, deleted or requeued): nothing changed.
    Stale,
}

impl Store {
    /// Hands a reserved job back, due again after `delay`; `false` if it was no longer
    /// ours. See `lua/retry.lua`.
    pub async fn retry(&self, lease: &Lease, delay: Duration) -> Result<bool, StoreError> {
        let topic = &lease.topic;
        let call = Scripts::call(&self.exec.scripts().retry, topic, &self.keys)
            .arg(lease.id.as_str())
            .arg(lease.token)
            .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
        let moved: i64 = redis::from_redis_value(self.exec.run_one(call).await?)
            .map_err(|e| StoreError::bad_reply("retry", e.to_string()))?;
        Ok(moved == 1)
    }

    /// Hands a reserved job back after a failed publish, recording `reason` (cut to 256
    /// bytes) and the server's time on it; parks it when its recorded failures reach
    /// `max_attempts` (0 = never). See `lua/retry.lua`.
    pub async fn retry_failed(
        &self,
        lease: &Lease,
        delay: Duration,
        reason: &str,
        max_attempts: u32,
    ) -> Result<RetryOutcome, StoreError> {
        let topic = &lease.topic;
        let call = Scripts::call(&self.exec.scripts().retry, topic, &self.keys)
            .arg(lease.id.as_str())
            .arg(lease.token)
            .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))
            .arg(short_reason(reason))
            .arg(max_attempts)
            .arg(self.history_max);
        let moved: i64 = redis::from_redis_value(self.exec.run_one(call).await?)
            .map_err(|e| StoreError::bad_reply("retry", e.to_string()))?;
        match moved {
            0 => Ok(RetryOutcome::Stale),
            1 => Ok(RetryOutcome::Retried),
            2 => Ok(RetryOutcome::Parked),
            other => Err(StoreError::bad_reply("retry", format!("reply {other}"))),
        }
    }
}

/// At most [`MAX_ERROR_BYTES`], cut at a character boundary.
fn short_reason(reason: &str) -> &str {
    if reason.len() <= MAX_ERROR_BYTES {
        return reason;
    }
    let mut end = MAX_ERROR_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_reasons_are_cut_at_a_character_boundary() {
        let reason = "é".repeat(200);
        let cut = short_reason(&reason);
        assert!(cut.len() <= MAX_ERROR_BYTES && cut.len() >= MAX_ERROR_BYTES - 1);
        assert!(reason.starts_with(cut));
        assert_eq!(short_reason("nack"), "nack");
    }
}

//! `lua/stats.lua`: a topic's jobs counted by state, with its rate limit's view
//! (`rate_limit.rs`) in the same round trip.

use serde::Serialize;

use super::rate_limit::{decode_rate_state, RateSource};
use crate::job::Topic;
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

/// A topic's jobs counted by state.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct TopicStats {
    pub now: i64,
    pub scheduled: u64,
    pub due_now: u64,
    pub reserved: u64,
    pub expired: u64,
    pub records: u64,
    /// Parked after too many failed publishes (not counted in `scheduled`).
    pub parked: u64,
    pub paused: bool,
    /// Jobs with a recorded failure (`last_error`), parked ones included.
    pub failing: u64,
    /// Entries in the topic's outcome history.
    pub history: u64,
    /// Due jobs its rate limit holds back now (0 without a limit).
    pub throttled: u64,
    /// The rate limit in force and where it comes from; `None`: unlimited.
    #[serde(skip)]
    pub rate_limit: Option<(crate::policy::RateLimit, RateSource)>,
}

impl Store {
    /// A topic's jobs counted by state. See `lua/stats.lua`.
    pub async fn stats(&self, topic: &Topic) -> Result<TopicStats, StoreError> {
        let call = Scripts::call(&self.exec.scripts().stats, topic, &self.keys);
        // The rate limit's view rides in the same round trip (same slot).
        let mut replies = self
            .exec
            .run(&[call, self.rate_get_call(topic)])
            .await?
            .into_iter();
        let (Some(stats), Some(rate)) = (replies.next(), replies.next()) else {
            return Err(StoreError::bad_reply("stats", "a call got no reply"));
        };
        let rate = decode_rate_state(rate?)?;
        let mut reply = Reader::new("stats", stats?)?;
        let mut count = |what| reply.int(what).map(|n| u64::try_from(n).unwrap_or(0));
        Ok(TopicStats {
            now: count("now")? as i64,
            scheduled: count("scheduled")?,
            due_now: count("due_now")?,
            reserved: count("reserved")?,
            expired: count("expired")?,
            records: count("records")?,
            parked: count("parked")?,
            paused: count("paused")? == 1,
            failing: count("failing")?,
            history: count("history")?,
            throttled: rate.throttled,
            rate_limit: rate.limit,
        })
    }
}

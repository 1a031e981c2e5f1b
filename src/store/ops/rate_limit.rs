//! Rate limits per topic (`lua/rate_limit.lua`; enforced by `lua/reserve.lua`): the
//! live limit stored in Redis, which overrides the configuration's policy. `stats.rs`
//! rides [`Store::rate_state`]'s call in its own round trip.

use redis::Value;
use serde::Serialize;

use crate::job::Topic;
use crate::policy::RateLimit;
use crate::store::call::Call;
use crate::store::reply::{optional_time, Reader};
use crate::store::scripts::Scripts;
use crate::store::{Store, StoreError};

/// Where the rate limit in force comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RateSource {
    /// Set through the API or the CLI, stored in Redis: every bridge obeys it.
    Live,
    /// The configuration's `[[policies]]` entry for the topic.
    Policy,
}

/// A topic's rate limit in force, and what it holds back now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateState {
    pub limit: Option<(RateLimit, RateSource)>,
    pub throttled: u64,
    pub next_token: Option<i64>,
    pub now: i64,
}

impl Store {
    /// Stores `limit` as the topic's live limit: every bridge obeys it at its next
    /// reserve. The bucket's state is kept, so a change grants no fresh burst.
    pub async fn set_rate_limit(&self, topic: &Topic, limit: RateLimit) -> Result<(), StoreError> {
        self.register_now(&[topic]).await?;
        let call = self
            .rate_call(topic, "set")
            .arg(limit.rate_arg())
            .arg(limit.burst);
        self.exec.run_one(call).await?;
        Ok(())
    }

    /// Removes the topic's live limit (the policy's, if any, applies again); `false`
    /// if there was none.
    pub async fn delete_rate_limit(&self, topic: &Topic) -> Result<bool, StoreError> {
        let call = self.rate_call(topic, "delete");
        Ok(self.exec.run_one(call).await? == Value::Int(1))
    }

    /// The limit in force for `topic` and what it holds back now.
    pub async fn rate_state(&self, topic: &Topic) -> Result<RateState, StoreError> {
        let value = self.exec.run_one(self.rate_get_call(topic)).await?;
        decode_rate_state(value)
    }

    pub(super) fn rate_get_call(&self, topic: &Topic) -> Call {
        let call = self.rate_call(topic, "get");
        match self.policies().rate_for(topic) {
            Some(rate) => call.arg(rate.rate_arg()).arg(rate.burst),
            None => call.arg("").arg(""),
        }
    }

    fn rate_call(&self, topic: &Topic, op: &str) -> Call {
        let keys = self.keys.limited(topic);
        Scripts::call_with_keys(&self.exec.scripts().rate_limit, topic, &keys).arg(op)
    }
}

pub(super) fn decode_rate_state(value: Value) -> Result<RateState, StoreError> {
    let mut reply = Reader::new("rate_limit", value)?;
    let now = reply.int("now")?;
    let rate = reply.string("max_per_second")?;
    let burst = reply.int("burst")?;
    let source = match reply.string("source")?.as_str() {
        "live" => Some(RateSource::Live),
        "default" => Some(RateSource::Policy),
        _ => None,
    };
    let throttled = u64::try_from(reply.int("throttled")?).unwrap_or(0);
    let next_token = optional_time(reply.int("next_token")?);
    let limit = match source {
        None => None,
        Some(source) => {
            let max_per_second = rate
                .parse::<f64>()
                .map_err(|_| StoreError::bad_reply("rate_limit", format!("rate {rate:?}")))?;
            let burst = u32::try_from(burst).unwrap_or(1);
            Some((
                RateLimit {
                    max_per_second,
                    burst,
                },
                source,
            ))
        }
    };
    Ok(RateState {
        limit,
        throttled,
        next_token,
        now,
    })
}

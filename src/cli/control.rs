//! The commands that steer a topic's dispatch: `pause`, `resume`, `rate-limit` and
//! `redrive`.

use crate::job::{JobId, Topic};
use crate::policy::RateLimit;
use crate::store::{RateSource, Store};
use crate::view::{self, PauseView, RateLimitView, RedriveView};

use super::output::Output;
use super::CliError;

/// What `rate-limit` was asked: `None` show, `Some(None)` remove, `Some(Some(_))` set.
pub(super) fn rate_change(
    rate: Option<&str>,
    burst: Option<&str>,
) -> Result<Option<Option<RateLimit>>, CliError> {
    let usage = |e: crate::policy::RateError| CliError::Usage(e.0);
    match rate {
        None if burst.is_some() => Err(CliError::Usage(
            "--burst needs a rate: redisched rate-limit <topic> <n>/s --burst <k>".into(),
        )),
        None => Ok(None),
        Some("off") if burst.is_some() => {
            Err(CliError::Usage("--burst makes no sense with `off`".into()))
        }
        Some("off") => Ok(Some(None)),
        Some(rate) => {
            let rate = RateLimit::parse_rate(rate).map_err(usage)?;
            let burst = match burst {
                None => None,
                Some(b) => Some(b.trim().parse::<f64>().map_err(|_| {
                    CliError::Usage(format!("--burst must be a whole number >= 1, got {b:?}"))
                })?),
            };
            Ok(Some(Some(RateLimit::new(rate, burst).map_err(usage)?)))
        }
    }
}

pub(super) async fn rate_limit(
    store: &Store,
    topic: &Topic,
    change: Option<Option<RateLimit>>,
) -> Result<Output, CliError> {
    let changed = match change {
        None => false,
        Some(Some(limit)) => {
            store.set_rate_limit(topic, limit).await?;
            true
        }
        Some(None) => store.delete_rate_limit(topic).await?,
    };
    let state = store.rate_state(topic).await?;
    let in_force = match state.limit {
        None => "unlimited".to_string(),
        Some((limit, RateSource::Live)) => format!("limited to {limit} (live)"),
        Some((limit, RateSource::Policy)) => {
            format!("limited to {limit} (the configuration's [[policies]])")
        }
    };
    let human = match change {
        Some(None) if !changed => format!("topic {topic} had no live rate limit; it is {in_force}"),
        _ => format!(
            "topic {topic} is {in_force}; {} due job(s) held back now",
            state.throttled
        ),
    };
    let json = view::to_json(&RateLimitView::new(topic, &state, changed));
    Ok(Output { json, human })
}

/// `pause` (`paused = true`) and `resume`.
pub(super) async fn pause(store: &Store, topic: &Topic, paused: bool) -> Result<Output, CliError> {
    let changed = if paused {
        store.pause(topic).await?
    } else {
        store.resume(topic).await?
    };
    let human = match (paused, changed) {
        (true, true) => format!(
            "paused topic {topic}: nothing of it is dispatched until `redisched resume {topic}`"
        ),
        (true, false) => format!("topic {topic} was paused already"),
        (false, true) => format!("resumed topic {topic}: its due jobs are dispatched"),
        (false, false) => format!("topic {topic} was not paused"),
    };
    let json = view::to_json(&PauseView {
        topic: topic.clone(),
        paused,
        changed,
    });
    Ok(Output { json, human })
}

pub(super) async fn redrive(
    store: &Store,
    topic: &Topic,
    id: Option<&JobId>,
) -> Result<Output, CliError> {
    let (redriven, human) = match id {
        Some(id) => {
            if !store.redrive(topic, id).await? {
                let info = store.get(topic, id).await?;
                let (_, why) = view::not_parked(topic, id, info.as_ref());
                return Err(CliError::NotFound(why));
            }
            (1, format!("re-drove {topic}/{id}: due now"))
        }
        None => {
            let moved = store.redrive_topic(topic).await?;
            let human = match moved {
                0 => format!("no parked jobs in topic {topic}"),
                n => format!("re-drove {n} parked job(s) of topic {topic}: due now"),
            };
            (moved, human)
        }
    };
    let json = view::to_json(&RedriveView {
        topic: topic.clone(),
        id: id.map(|id| id.to_string()),
        redriven,
    });
    Ok(Output { json, human })
}

//! `lua/redrive_window.lua`: the parked jobs of a topic whose last failure falls in a
//! time window made due now (attempts kept), a bounded step at a time with a cursor.

use crate::job::window::FailureWindow;
use crate::job::Topic;
use crate::store::reply::Reader;
use crate::store::scripts::Scripts;
use crate::store::types::MAX_BATCH;
use crate::store::{Store, StoreError};

/// What one [`Store::redrive_window_step`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowStep {
    /// Parked jobs made due now.
    pub moved: u64,
    /// Entries of the topic's `failing` index examined.
    pub scanned: u64,
    /// Where the next step starts; `None` when the window is done.
    pub cursor: Option<String>,
}

impl Store {
    /// One step over a topic's failing jobs in `window`: examines at most `count`
    /// (1..=1000) of them after `cursor` (`None` to begin) and makes the parked ones
    /// due now. Safe to repeat: a job moved is no longer parked.
    pub async fn redrive_window_step(
        &self,
        topic: &Topic,
        window: FailureWindow,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<WindowStep, StoreError> {
        let call = Scripts::call(&self.exec.scripts().redrive_window, topic, &self.keys)
            .arg(window.since)
            .arg(window.until)
            .arg(cursor.unwrap_or(""))
            .arg(count.clamp(1, MAX_BATCH))
            .arg(self.keys.notify_channel())
            .arg(self.history_max);
        let mut reply = Reader::new("redrive_window", self.exec.run_one(call).await?)?;
        let moved = u64::try_from(reply.int("moved")?).unwrap_or(0);
        let scanned = u64::try_from(reply.int("scanned")?).unwrap_or(0);
        let cursor = reply.string("cursor")?;
        Ok(WindowStep {
            moved,
            scanned,
            cursor: (!cursor.is_empty()).then_some(cursor),
        })
    }

    /// Every parked job of a topic whose last failure falls in `window` due now,
    /// [`MAX_BATCH`] entries examined per script call; how many moved.
    pub async fn redrive_window(
        &self,
        topic: &Topic,
        window: FailureWindow,
    ) -> Result<u64, StoreError> {
        let mut total = 0;
        let mut cursor = None;
        loop {
            let step = self
                .redrive_window_step(topic, window, cursor.as_deref(), MAX_BATCH)
                .await?;
            total += step.moved;
            match step.cursor {
                Some(next) => cursor = Some(next),
                None => return Ok(total),
            }
        }
    }

    /// [`Store::redrive_window`] over several topics, one after another: how many
    /// moved in each, in the order given.
    pub async fn redrive_window_topics(
        &self,
        topics: &[Topic],
        window: FailureWindow,
    ) -> Result<Vec<(Topic, u64)>, StoreError> {
        let mut moved = Vec::with_capacity(topics.len());
        for topic in topics {
            moved.push((topic.clone(), self.redrive_window(topic, window).await?));
        }
        Ok(moved)
    }
}

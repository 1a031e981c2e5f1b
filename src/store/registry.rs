//! The topics registry, `<prefix>:topics`: the SET the dispatchers' safety net, the
//! requeue sweep, the CLI and the HTTP API walk to find topics. The scripts never touch
//! it (it lives in its own Cluster slot), so the store adds a topic before its jobs.
//!
//! Adding a member the set already holds changes nothing but still costs Redis a
//! command, once per batch and topic (for a single put, one command of two). So the
//! store remembers what it registered, and trusts that memory only as long as it can:
//! - for [`DEFAULT_TOPIC_REFRESH`] per topic: a set deleted by hand holds every topic
//!   still being put to again within that time;
//! - only on the server it registered them on: the executor's script epoch changes when
//!   Redis answered `NOSCRIPT` (a restart, a failover to a node without the scripts,
//!   `SCRIPT FLUSH`), and then everything is forgotten and registered again, so a Redis
//!   that came back empty gets its topics back with the first batch that meets it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::call::Call;
use super::{Store, StoreError};
use crate::job::Topic;

/// How long a registration is trusted before the next put of the topic adds it again.
pub const DEFAULT_TOPIC_REFRESH: Duration = Duration::from_secs(10);

/// Remembered registrations are pruned of expired ones beyond this many topics, so a
/// store that sees many short-lived topics keeps only those registered lately.
const PRUNE_ABOVE: usize = 10_000;

#[derive(Debug)]
pub(crate) struct TopicRegistry {
    refresh: Duration,
    state: Mutex<Registered>,
}

#[derive(Debug, Default)]
struct Registered {
    /// The executor's script epoch the entries were registered under.
    epoch: u64,
    at: HashMap<Topic, Instant>,
}

impl TopicRegistry {
    pub(crate) fn new(refresh: Duration) -> Self {
        Self {
            refresh,
            state: Mutex::new(Registered::default()),
        }
    }

    pub(crate) fn refresh(&self) -> Duration {
        self.refresh
    }

    /// The topics of `wanted` to register now: not registered under `epoch` within the
    /// refresh time. `wanted` holds each topic once.
    pub(crate) fn unregistered<'t>(&self, epoch: u64, wanted: &[&'t Topic]) -> Vec<&'t Topic> {
        let mut state = self.lock();
        if state.epoch != epoch {
            state.at.clear();
            state.epoch = epoch;
        }
        let now = Instant::now();
        wanted
            .iter()
            .copied()
            .filter(|topic| {
                state
                    .at
                    .get(*topic)
                    .is_none_or(|at| now.duration_since(*at) >= self.refresh)
            })
            .collect()
    }

    /// `topics` were added to the set by a command sent at `sent`, under `epoch`.
    pub(crate) fn registered(&self, epoch: u64, sent: Instant, topics: &[&Topic]) {
        let mut state = self.lock();
        if state.epoch != epoch {
            return;
        }
        if state.at.len() + topics.len() > PRUNE_ABOVE {
            let refresh = self.refresh;
            state.at.retain(|_, at| at.elapsed() < refresh);
        }
        for topic in topics {
            state.at.insert((*topic).clone(), sent);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registered> {
        // The map is a cache: after a panic elsewhere its content is still valid.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Store {
    /// `SADD <prefix>:topics <topics…>`, to run before the topics' first calls.
    pub(super) fn register_call(&self, topics: &[&Topic]) -> Call {
        let mut sadd = redis::cmd("SADD");
        sadd.arg(self.keys.topics());
        for topic in topics {
            sadd.arg(topic.as_str());
        }
        Call::global(sadd)
    }

    /// Registers `topics` at once, whatever the store remembers.
    pub(super) async fn register_now(&self, topics: &[&Topic]) -> Result<(), StoreError> {
        let epoch = self.exec.script_epoch();
        let sent = Instant::now();
        self.exec.run_one(self.register_call(topics)).await?;
        self.registry.registered(epoch, sent, topics);
        Ok(())
    }
}

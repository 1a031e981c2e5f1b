//! Live events for watchers (the dashboard's server-sent events): dispatched jobs and
//! applied commands. Lossy by design: a slow watcher misses events, the bridge never waits.

use serde::Serialize;
use tokio::sync::broadcast;

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// A job was published, confirmed and released.
    Dispatched {
        topic: String,
        id: String,
        due_at: i64,
        attempt: u32,
        /// Confirmed at, by the bridge's clock (epoch ms).
        at: i64,
        lateness_ms: i64,
    },
    /// A job was not delivered by its due time + expires-after: set aside to the
    /// expired exchange (confirmed) and released.
    Expired {
        topic: String,
        id: String,
        due_at: i64,
        attempt: u32,
        expires_after_ms: u64,
        /// Released at, by the bridge's clock (epoch ms).
        at: i64,
    },
    /// A command changed (or tried to change) the store.
    Command {
        topic: String,
        id: String,
        op: String,
        outcome: String,
    },
}

#[derive(Debug, Clone)]
pub struct Feed {
    sender: broadcast::Sender<Event>,
}

impl Feed {
    pub fn new() -> Self {
        let (sender, _) = broadcast::channel(1024);
        Self { sender }
    }

    pub fn send(&self, event: Event) {
        // No subscriber is the normal case; nothing to do then.
        self.sender.send(event).ok();
    }

    /// Builds and sends an event only while someone watches (the dashboard's event
    /// stream): ingest and dispatch call this per command and per job, and with no
    /// watcher the event's strings would be built for nothing.
    pub fn send_with(&self, event: impl FnOnce() -> Event) {
        if self.sender.receiver_count() > 0 {
            // Its last watcher may have left since the count: nothing to do then.
            self.sender.send(event()).ok();
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.sender.subscribe()
    }
}

impl Default for Feed {
    fn default() -> Self {
        Self::new()
    }
}

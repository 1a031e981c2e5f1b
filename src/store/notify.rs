//! Notifications: how a dispatcher learns that a topic has work earlier than it
//! planned for, without the stages knowing each other.
//!
//! Three sources feed the same [`DueHints`]: the ingest stage (in-process, for commands
//! this bridge applied), dispatch's settling (in-process, a series it released to its
//! next occurrence, a job it handed back for a retry) and Redis Pub/Sub (the put and requeue scripts publish on
//! `<prefix>:notify` when a topic's head moves earlier, whoever called them), which
//! only the store subscribes to and parses. Hints only wake the dispatcher early;
//! correctness never depends on them, because the reserve script decides what is due
//! by the server's clock and a periodic rescan catches anything missed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::conn::cluster_seeds;
use super::Store;
use crate::job::Topic;

/// How often the subscription proves it is alive with a PING (answered within
/// `redis.response_timeout_ms`, or it is replaced). Bounds how long a half-open
/// subscription can hide wake-ups; the rescan (`dispatch.poll_interval_ms`) still
/// catches up on anything missed meanwhile.
pub const SUBSCRIPTION_PING_INTERVAL: Duration = Duration::from_secs(5);

/// The board where hints wait for a dispatcher: the earliest hinted due time per
/// topic, and whether every topic must be looked at again. Fed by ingest (in-process,
/// for the commands it applied), by dispatch (a released series' next occurrence) and
/// by [`Store::follow_notifications`].
#[derive(Debug, Default)]
pub struct DueHints {
    hints: Mutex<HashMap<Topic, i64>>,
    rescan: AtomicBool,
    notify: Notify,
    /// Boards that get a copy of every hint and rescan request ([`DueHints::tee`]).
    copies: Mutex<Vec<Arc<DueHints>>>,
}

impl DueHints {
    pub fn new() -> Self {
        Self::default()
    }

    /// A second board fed with everything this one gets from now on, for a second
    /// dispatcher (webhook targets run their own loop, independent of the broker).
    pub fn tee(&self) -> Arc<DueHints> {
        let copy = Arc::new(DueHints::new());
        if let Ok(mut copies) = self.copies.lock() {
            copies.push(copy.clone());
        }
        copy
    }

    fn for_copies(&self, each: impl Fn(&DueHints)) {
        if let Ok(copies) = self.copies.lock() {
            for copy in copies.iter() {
                each(copy);
            }
        }
    }

    /// `topic` has a job due at `due_at` (server epoch ms).
    pub fn hint(&self, topic: &Topic, due_at: i64) {
        self.for_copies(|copy| copy.hint(topic, due_at));
        if let Ok(mut hints) = self.hints.lock() {
            hints
                .entry(topic.clone())
                .and_modify(|d| *d = (*d).min(due_at))
                .or_insert(due_at);
        }
        self.notify.notify_one();
    }

    /// Hints may have been missed (the subscription reconnected): look at every topic
    /// again.
    pub fn request_rescan(&self) {
        self.for_copies(DueHints::request_rescan);
        self.rescan.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    pub fn take_hints(&self) -> HashMap<Topic, i64> {
        self.hints
            .lock()
            .map(|mut h| std::mem::take(&mut *h))
            .unwrap_or_default()
    }

    pub fn take_rescan(&self) -> bool {
        self.rescan.swap(false, Ordering::AcqRel)
    }

    /// Waits for the next hint or rescan request.
    pub async fn notified(&self) {
        self.notify.notified().await;
    }
}

/// Parses a notification payload `'<due_at>|<topic>'` (defined by `lua/put.lua` and
/// `lua/requeue.lua`).
fn parse_notification(payload: &[u8]) -> Option<(Topic, i64)> {
    let text = std::str::from_utf8(payload).ok()?;
    let (due, topic) = text.split_once('|')?;
    Some((Topic::new(topic).ok()?, due.parse().ok()?))
}

impl Store {
    /// Follows the notifications the scripts publish (a topic's head moved earlier) into
    /// `hints` until shutdown, resubscribing with backoff. After each (re)subscription it
    /// asks for a rescan, since notifications sent while it was away are lost.
    pub async fn follow_notifications(&self, hints: Arc<DueHints>, shutdown: CancellationToken) {
        let redis_url = &self.options.url;
        let ca_file = &self.options.tls_ca_file;
        let channel = self.keys.notify_channel();
        // In a cluster, PUBLISH reaches every node: any one node will do, and after a
        // failure the next seed is tried.
        let nodes = cluster_seeds(redis_url).unwrap_or_else(|| vec![redis_url.clone()]);
        if nodes.is_empty() {
            tracing::error!("no Redis node to subscribe to; dispatch relies on polling");
            return;
        }
        let mut attempt = 0usize;
        let mut backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            let node = nodes[attempt % nodes.len()].clone();
            attempt += 1;
            let subscribed = async {
                let client = crate::tls::redis_client(node.as_str(), ca_file.as_deref())?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(&channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            }
            .await;
            match subscribed {
                Ok(pubsub) => {
                    backoff = Duration::from_millis(100);
                    hints.request_rescan();
                    let (mut sink, mut messages) = pubsub.split();
                    let mut health = tokio::time::interval(SUBSCRIPTION_PING_INTERVAL);
                    health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    health.tick().await; // the first tick is immediate; we just subscribed
                    loop {
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            message = messages.next() => match message {
                                Some(message) => {
                                    if let Some((topic, due)) = parse_notification(message.get_payload_bytes()) {
                                        hints.hint(&topic, due);
                                    }
                                }
                                None => {
                                    tracing::warn!("notification subscription lost; resubscribing");
                                    break;
                                }
                            },
                            _ = health.tick() => {
                                // A half-open connection (peer gone, no FIN or RST) delivers
                                // nothing and reports nothing: only a reply proves it alive.
                                let timeout = self.options.response_timeout;
                                match tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await {
                                    Ok(Ok(_)) => {}
                                    Ok(Err(err)) => {
                                        tracing::warn!(error = %err, "notification subscription failed its PING; resubscribing");
                                        break;
                                    }
                                    Err(_) => {
                                        tracing::warn!(?timeout, "notification subscription did not answer PING; resubscribing");
                                        break;
                                    }
                                }
                            }
                        }
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, "cannot subscribe to notifications; retrying")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_parse_and_hints_keep_the_earliest() {
        assert_eq!(
            parse_notification(b"1700000000000|mail.welcome"),
            Some((Topic::new("mail.welcome").unwrap(), 1_700_000_000_000))
        );
        assert_eq!(parse_notification(b"garbage"), None);
        let hints = DueHints::new();
        let topic = Topic::new("t").unwrap();
        hints.hint(&topic, 50);
        hints.hint(&topic, 20);
        hints.hint(&topic, 70);
        assert_eq!(hints.take_hints().get(&topic), Some(&20));
        assert!(hints.take_hints().is_empty());
    }
}

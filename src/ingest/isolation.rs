//! Isolating a message the AMQP client cannot parse (a `message_id` that is not UTF-8,
//! say): it ends the connection before the bridge sees it, and every unacked delivery
//! goes back to the queue with one more delivery counted, so with the normal prefetch a
//! whole window of valid commands would reach the queue's delivery limit along with it.
//! So after such an end, the consumers (a lane's session, the router) are *careful*: one
//! command at a time (prefetch 1, each acked once applied or forwarded), so only the
//! unparseable message is unacked when the connection ends, and only its count grows
//! until the broker dead-letters it at `amqp.delivery_limit`. A careful consumer returns
//! to the full window once its queue is empty ([`Careful::queue_empty`]) or once it
//! took a full window one by one ([`Careful::window_done`]): quorum queues redeliver
//! returned messages before newer ones, so by then every command the failed window
//! returned was acked, and a valid command gains at most one delivery per unparseable
//! message met at the normal prefetch.
//!
//! A consumer may meet the end of its connection elsewhere than at its next delivery (a
//! batch in flight finds its channel closed, an ack or a set-aside fails): [`why_ended`]
//! then reads the cause from the consumer, which lapin gave the connection's error
//! after the deliveries it still held, so that end isolates the message too.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::{Channel, Connection, Consumer};

use crate::amqp::{self, AmqpError};
use crate::config::AmqpConfig;

/// Whether a message the client library cannot parse is being isolated: one flag for
/// every consumer on the connection (the lanes and, partitioned, the router), since
/// lapin does not say whose delivery ended it.
#[derive(Debug, Default)]
pub struct Isolation {
    careful: AtomicBool,
    /// Sessions ended by an unparseable message since isolation began.
    ended: AtomicU32,
}

impl Isolation {
    /// Whether the next session is to be careful.
    pub(super) fn careful(&self) -> bool {
        self.careful.load(Relaxed)
    }

    /// A careful session found the unparseable message gone: the next ones take the
    /// full window again. Returns how many sessions it ended, for the log.
    pub(super) fn recovered(&self) -> u32 {
        let ended = self.ended.swap(0, Relaxed);
        self.careful.store(false, Relaxed);
        ended
    }

    /// After a session ended on a message the client library cannot parse: the next
    /// sessions are careful. Partitioned, the router and every lane go careful, as they
    /// share the connection (a lane whose queue is empty returns to the full window
    /// after two looks; marking only the consumer whose error came first left the
    /// router at the full window when the message was in the route queue). Logged once
    /// per isolation, in the operator's terms.
    pub(super) fn isolate(&self, cfg: &AmqpConfig, queue: &str, err: &AmqpError) {
        let ended = self.ended.fetch_add(1, Relaxed) + 1;
        let queue = if cfg.command_partitions > 1 {
            format!("{} or one of its partitions", amqp::route_queue(cfg))
        } else {
            queue.to_string()
        };
        let queue = queue.as_str();
        if self.careful.swap(true, Relaxed) {
            tracing::debug!(queue, sessions_ended = ended, error = %err, "the unparseable message ended another session");
            return;
        }
        if cfg.quorum_queues && cfg.delivery_limit > 0 {
            tracing::warn!(queue, error = %err, delivery_limit = cfg.delivery_limit, invalid_exchange = %cfg.invalid_exchange,
                "a commands queue holds a message the AMQP client cannot parse (it ended the connection); isolating it: consuming one command at a time, so the commands behind it are applied, until the broker dead-letters it to the invalid exchange after amqp.delivery_limit deliveries");
        } else {
            tracing::error!(queue, error = %err,
                "a commands queue holds a message the AMQP client cannot parse (it ended the connection); this queue has no delivery limit (amqp.quorum_queues = false or amqp.delivery_limit = 0), so the broker redelivers it forever and the commands behind it wait: remove it from the queue by hand (e.g. with the management UI); consuming one command at a time meanwhile");
        }
    }
}

/// How a consumer's session ended, told by what ended its connection: when `channel` (the
/// consumer's) is no longer open and `ended` is not already an unparseable message's end,
/// the deliveries the consumer still holds are read past (none is acked: the broker
/// returns them) to the error lapin gave it; if that error is a message the client
/// library cannot parse, that is the session's end. Otherwise `ended` as it was (an open
/// channel: shutdown, recovered, handed over; or a connection lost for another reason).
pub(super) async fn why_ended<T>(
    ended: Result<T, AmqpError>,
    channel: &Channel,
    consumer: &mut Consumer,
) -> Result<T, AmqpError> {
    if channel.status().connected() || ended.as_ref().is_err_and(AmqpError::is_unparseable) {
        return ended;
    }
    // lapin marks the channel closed just before it hands its consumers the error (behind
    // the deliveries they hold), so the error may be a moment away; a consumer that
    // ended otherwise ends its stream.
    let cause = tokio::time::timeout(CAUSE_WAIT, async {
        loop {
            match consumer.next().await {
                Some(Ok(_held)) => {}
                Some(Err(err)) => return Some(AmqpError::from(err)),
                None => return None,
            }
        }
    })
    .await;
    match cause {
        Ok(Some(err)) if err.is_unparseable() => Err(err),
        _ => ended,
    }
}

/// How long [`why_ended`] waits for a closed channel's consumer to be given its error.
const CAUSE_WAIT: Duration = Duration::from_secs(1);

/// A careful session looks at its queue once nothing came for this long with nothing in
/// hand ...
pub(super) const ISOLATION_IDLE: Duration = Duration::from_millis(500);
/// ... and returns to the full window once this many looks in a row found no ready
/// message in it. Silence alone is not an empty queue: a loaded broker may take longer
/// to redeliver the unparseable message, and a full window taken with it still at the
/// head would count one more delivery against every valid command behind it (found by
/// the deep-headers poison test under CI's load: the valid commands reached the
/// delivery limit).
const EMPTY_LOOKS: u8 = 2;

/// Whether a session is careful, and its way back to the full window: the commands it
/// took one by one, and its looks at its queue.
#[derive(Debug)]
pub(super) struct Careful {
    on: bool,
    /// The normal window (the prefetch): taken one by one, it is safe to return to.
    window: usize,
    taken: usize,
    /// Looks in a row that found the queue without a ready message.
    empty_looks: u8,
}

impl Careful {
    /// A session's care: `on` after an unparseable message ended a session.
    pub(super) fn new(on: bool, window: usize) -> Self {
        Self {
            on,
            window,
            taken: 0,
            empty_looks: 0,
        }
    }

    /// Whether the session is careful: one command at a time.
    pub(super) fn is_on(&self) -> bool {
        self.on
    }

    /// A delivery came: the queue was not empty.
    pub(super) fn delivered(&mut self) {
        self.empty_looks = 0;
    }

    /// `n` more commands were applied (or forwarded) and acked.
    pub(super) fn done(&mut self, n: usize) {
        self.taken += n;
    }

    /// Whether a careful session took a full normal window one by one.
    pub(super) fn window_done(&self) -> bool {
        self.on && self.taken >= self.window
    }

    /// Looks once; whether the broker found no ready message [`EMPTY_LOOKS`] looks in
    /// a row, so the session may return to the full window.
    pub(super) async fn queue_empty(
        &mut self,
        connection: &Connection,
        queue: &str,
    ) -> Result<bool, AmqpError> {
        let state = amqp::queue_state(connection, queue).await?;
        Ok(self.looked(state.is_none_or(|(ready, _)| ready == 0)))
    }

    /// Counts a look that found the queue `empty` (or not).
    fn looked(&mut self, empty: bool) -> bool {
        self.empty_looks = if empty {
            self.empty_looks.saturating_add(1)
        } else {
            0
        };
        self.empty_looks >= EMPTY_LOOKS
    }
}

#[cfg(test)]
mod tests {
    use super::Careful;

    #[test]
    fn a_careful_session_returns_after_a_full_window_or_two_empty_looks_in_a_row() {
        let mut careful = Careful::new(true, 3);
        careful.done(2);
        assert!(!careful.window_done());
        careful.done(1);
        assert!(careful.window_done());
        let mut not = Careful::new(false, 3);
        not.done(5);
        assert!(!not.window_done(), "not careful");

        let mut careful = Careful::new(true, 100);
        assert!(!careful.looked(true));
        // A delivery (or a ready message) in between starts the count again.
        careful.delivered();
        assert!(!careful.looked(true));
        assert!(!careful.looked(false));
        assert!(!careful.looked(true));
        assert!(careful.looked(true));
    }
}

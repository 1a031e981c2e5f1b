//! A lane: one commands queue as ingest consumes it, one session after another (the
//! commands queue, a command partition, or a previous topology's queue being drained),
//! each lane with its own channels, epoch and fence. And when a lane's session ends of
//! itself: a drained queue once idle ([`DRAIN_IDLE`]), and a partition shared out to
//! another bridge handed over ([`HandOver`]).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::store::Store;

/// One commands queue as ingest consumes it: its name, the store whose fenced writes
/// use the queue's fence (each command partition has its own), and whether it is a
/// previous topology's queue being drained.
#[derive(Debug)]
pub(super) struct Lane {
    pub(super) queue: String,
    pub(super) store: Store,
    pub(super) drain: bool,
    /// A command partition's lane: its place in the share-out.
    pub(super) share: Option<Share>,
}

impl Lane {
    /// The lane of the one commands queue.
    pub(super) fn new(queue: String, store: Store) -> Self {
        Self {
            queue,
            store,
            drain: false,
            share: None,
        }
    }
}

/// A command partition's place among the bridges (see `Ingest::share_out`).
#[derive(Debug)]
pub(super) struct Share {
    pub(super) partition: u16,
    /// Which partitions are this bridge's share.
    pub(super) owned: tokio::sync::watch::Receiver<Vec<bool>>,
    /// The lane's last session ended handing the partition over: the next one hands it
    /// over again only once it is active (got a delivery), not merely idle, so a
    /// waiting consumer does not keep reopening its channel.
    pub(super) handed_over: AtomicBool,
}

impl Share {
    pub(super) fn new(partition: u16, owned: tokio::sync::watch::Receiver<Vec<bool>>) -> Self {
        Self {
            partition,
            owned,
            handed_over: AtomicBool::default(),
        }
    }

    /// Whether this partition is another bridge's share: then, once its lane is the
    /// partition's active consumer, it hands the partition over (see [`HANDOVER_QUIET`]).
    fn shared_away(&self) -> bool {
        let k = usize::from(self.partition);
        !self.owned.borrow().get(k).copied().unwrap_or(true)
    }
}

/// A lane draining a previous topology's queue ends after this long with nothing
/// arriving and nothing in hand.
pub(super) const DRAIN_IDLE: Duration = Duration::from_secs(1);

/// A lane that is the active consumer of a partition shared out to another bridge hands
/// it over (closes its channel and consumes again, behind the other consumers) once it
/// has nothing in hand and nothing arrived for this long: then no prefetched command goes
/// back with it, so no command's delivery count grows. ...
pub(super) const HANDOVER_QUIET: Duration = Duration::from_millis(200);
/// ... and if the partition is never that quiet, after this long: it stops taking
/// deliveries, finishes the batches in hand, and closes; the commands prefetched then
/// go back to the queue (one delivery more each, towards `amqp.delivery_limit`).
pub(super) const HANDOVER_FORCE: Duration = Duration::from_secs(10);

/// A session's hand-over of its partition: whether it became the active consumer (a
/// delivery came), since when its partition is another bridge's share, when the last
/// delivery came.
#[derive(Debug)]
pub(super) struct HandOver {
    active: bool,
    shared_away_since: Option<Instant>,
    last_delivery: Instant,
    /// Shared away for [`HANDOVER_FORCE`]: the session takes no more deliveries.
    forced: bool,
    /// The partition is to be handed over, once the session is quiet.
    due: bool,
}

/// What the session is doing, as the hand-over rule needs it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Doing {
    /// Isolating an unparseable message: never hands over.
    pub careful: bool,
    /// Finishing its batches for shutdown: never hands over.
    pub draining: bool,
    /// Nothing in hand: no batch taken, in flight or put aside.
    pub quiet: bool,
}

impl HandOver {
    pub(super) fn new() -> Self {
        Self {
            active: false,
            shared_away_since: None,
            last_delivery: Instant::now(),
            forced: false,
            due: false,
        }
    }

    /// A delivery came: the session is its partition's active consumer.
    pub(super) fn delivered(&mut self, queue: &str, share: Option<&Share>) {
        self.last_delivery = Instant::now();
        if !self.active && share.is_some() {
            tracing::info!(queue = %queue, "active consumer of this command partition");
        }
        self.active = true;
    }

    /// Whether the session hands its partition over now (and ends). A lane not known to
    /// be active (no delivery yet) but idle hands over too: it costs nothing, and makes
    /// way for the owner if this lane was the active one.
    pub(super) fn now(&mut self, queue: &str, share: Option<&Share>, doing: Doing) -> bool {
        let Some(share) = share else {
            self.due = false;
            return false;
        };
        let shared_away = share.shared_away();
        if !shared_away {
            share.handed_over.store(false, Relaxed);
        }
        self.due = shared_away
            && !doing.careful
            && !doing.draining
            && (self.active || !share.handed_over.load(Relaxed));
        if !self.due {
            self.shared_away_since = None;
            self.forced = false;
            return false;
        }
        let since = *self.shared_away_since.get_or_insert_with(Instant::now);
        self.forced |= since.elapsed() >= HANDOVER_FORCE;
        if doing.quiet && (self.forced || self.last_delivery.elapsed() >= HANDOVER_QUIET) {
            if self.active {
                tracing::info!(queue = %queue, forced = self.forced, "handing this command partition over to the bridge it is shared out to");
            }
            share.handed_over.store(true, Relaxed);
            return true;
        }
        false
    }

    /// Whether the session is to hand over once quiet (it looks again after
    /// [`HANDOVER_QUIET`]).
    pub(super) fn due(&self) -> bool {
        self.due
    }

    /// Whether the session stops taking deliveries to hand over.
    pub(super) fn forced(&self) -> bool {
        self.forced
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(owned: bool) -> (Share, tokio::sync::watch::Sender<Vec<bool>>) {
        let (tx, rx) = tokio::sync::watch::channel(vec![true, owned]);
        (Share::new(1, rx), tx)
    }

    const QUIET: Doing = Doing {
        careful: false,
        draining: false,
        quiet: true,
    };

    #[test]
    fn a_partition_shared_away_is_handed_over_once_quiet_never_while_busy_or_careful() {
        let (share, owned) = partition(true);
        let share = Some(&share);
        let mut hand_over = HandOver::new();
        assert!(!hand_over.now("q", share, QUIET), "its own share");
        assert!(!HandOver::new().now("q", None, QUIET), "not a partition");
        owned.send_replace(vec![true, false]);
        // Idle and never active: hands over too (it costs nothing), once quiet for
        // HANDOVER_QUIET since the session began.
        assert!(!hand_over.now("q", share, QUIET) && hand_over.due());
        hand_over.last_delivery -= HANDOVER_QUIET;
        assert!(hand_over.now("q", share, QUIET));
        assert!(share.is_some_and(|s| s.handed_over.load(Relaxed)));
        // The next session, handed over before and not active: keeps consuming.
        let mut next = HandOver::new();
        assert!(!next.now("q", share, QUIET) && !next.due());
        // Once active, it hands over when quiet for HANDOVER_QUIET, not before.
        next.delivered("q", share);
        assert!(!next.now("q", share, QUIET) && next.due() && !next.forced());
        next.last_delivery -= HANDOVER_QUIET;
        let busy = Doing {
            quiet: false,
            ..QUIET
        };
        assert!(!next.now("q", share, busy), "batches in hand");
        let careful = Doing {
            careful: true,
            ..QUIET
        };
        assert!(!next.now("q", share, careful) && !next.due(), "isolating");
        assert!(next.now("q", share, QUIET));
        // Its own share again: the mark is cleared.
        owned.send_replace(vec![true, true]);
        assert!(!HandOver::new().now("q", share, QUIET));
        assert!(share.is_some_and(|s| !s.handed_over.load(Relaxed)));
    }

    #[test]
    fn a_partition_never_quiet_is_forced_after_handover_force() {
        let (share, _owned) = partition(false);
        let share = Some(&share);
        let mut hand_over = HandOver::new();
        hand_over.delivered("q", share);
        let busy = Doing {
            quiet: false,
            ..QUIET
        };
        assert!(!hand_over.now("q", share, busy) && !hand_over.forced());
        hand_over.shared_away_since = Instant::now().checked_sub(HANDOVER_FORCE);
        assert!(
            !hand_over.now("q", share, busy) && hand_over.forced(),
            "stops taking"
        );
        // Once what it holds is done, it goes, however recent the last delivery.
        assert!(hand_over.now("q", share, QUIET));
    }
}

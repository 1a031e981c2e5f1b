//! The AMQP sink's channels on one dispatch session's connection: `dispatch.channels`
//! confirm channels ([`Lane`]s), each with a confirmer of its own (`confirm.rs`: a
//! channel's confirms and returns are matched against that channel's publishes alone),
//! taking turns per reserved batch; and whether the broker blocks publishers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::{Channel, Connection};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use super::confirm::{Confirmer, InFlight};
use crate::amqp::{self, AmqpError};
use crate::dispatch::settle::Settler;
use crate::log_throttle::LogThrottle;

/// One confirm channel and the sender to its own confirmer.
#[derive(Debug)]
pub(super) struct Lane {
    pub(super) channel: Channel,
    pub(super) in_flight: mpsc::UnboundedSender<InFlight>,
}

/// The lanes of one session, their confirmers and the broker's block.
#[derive(Debug)]
pub(super) struct Lanes {
    lanes: Vec<Lane>,
    /// Aborted if the session is dropped (`amqp::while_connected` drops one whose
    /// connection died under it): their jobs stay reserved and are requeued.
    confirmers: Vec<AbortOnDropHandle<()>>,
    /// Which lane publishes the next reserved batch.
    turn: AtomicUsize,
    blocked: watch::Receiver<bool>,
}

impl Lanes {
    /// Opens `count` confirm channels on `connection`, each with its confirmer.
    pub(super) async fn open(
        connection: &Connection,
        count: usize,
        settler: &Settler,
        warnings: &Arc<LogThrottle>,
        shutdown: &CancellationToken,
    ) -> Result<Self, AmqpError> {
        let blocked = watch_blocked(connection, shutdown.clone());
        let mut lanes = Vec::with_capacity(count);
        let mut confirmers = Vec::with_capacity(count);
        for _ in 0..count {
            let channel = amqp::confirm_channel(connection).await?;
            let (in_flight, confirmed) = mpsc::unbounded_channel();
            let confirmer = Confirmer {
                settler: settler.clone(),
                warnings: warnings.clone(),
            };
            confirmers.push(AbortOnDropHandle::new(tokio::spawn(
                confirmer.run(confirmed),
            )));
            lanes.push(Lane { channel, in_flight });
        }
        Ok(Self {
            lanes,
            confirmers,
            turn: AtomicUsize::new(0),
            blocked,
        })
    }

    /// The lane of the next reserved batch: each in turn, so that a busy topic's
    /// batches spread over every channel while each batch stays in order on one.
    pub(super) fn next(&self) -> &Lane {
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        &self.lanes[turn % self.lanes.len()]
    }

    pub(super) fn blocked(&self) -> bool {
        *self.blocked.borrow()
    }

    /// Waits while the broker blocks publishers (a resource alarm), or until shutdown.
    pub(super) async fn wait_unblocked(&self, shutdown: &CancellationToken) {
        tracing::warn!("broker blocked publishers (resource alarm); dispatch paused");
        let mut blocked = self.blocked.clone();
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = blocked.wait_for(|b| !*b) => {
                tracing::info!("broker unblocked; dispatch resumes");
            }
        }
    }

    /// Ends the session's publishing: each confirmer settles what it has (until `grace`
    /// has passed; the rest stays reserved), then the channels close.
    pub(super) async fn close(self, grace: Duration) {
        let Self {
            lanes,
            mut confirmers,
            ..
        } = self;
        // A confirmer ends once its sender is gone and its publishes are settled.
        let channels: Vec<Channel> = lanes.into_iter().map(|lane| lane.channel).collect();
        let deadline = tokio::time::Instant::now() + grace;
        let mut pending = false;
        for confirmer in &mut confirmers {
            if tokio::time::timeout_at(deadline, &mut *confirmer)
                .await
                .is_err()
            {
                confirmer.abort();
                pending = true;
            }
        }
        if pending {
            tracing::warn!(
                ?grace,
                "confirms still pending at the end of the grace period; those jobs stay reserved and are requeued after their time-to-run"
            );
        }
        let closing = channels.iter().map(|channel| {
            amqp::close_quietly("dispatch channel", channel.close(200, "shutdown".into()))
        });
        futures_util::future::join_all(closing).await;
    }
}

/// Tracks connection.blocked / unblocked: while blocked, publishes would only pile up
/// unconfirmed and their reservations would expire, so the loop pauses instead.
fn watch_blocked(connection: &Connection, shutdown: CancellationToken) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    let mut events = Box::pin(connection.events_listener());
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tx.closed() => return,
                event = events.next() => event,
            };
            match event {
                Some(lapin::Event::ConnectionBlocked(reason)) => {
                    tracing::warn!(%reason, "connection blocked by the broker");
                    tx.send_replace(true);
                }
                Some(lapin::Event::ConnectionUnblocked) => {
                    tx.send_replace(false);
                }
                Some(_) => {}
                None => return,
            }
        }
    });
    rx
}

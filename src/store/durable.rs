//! Waiting for replicas (`redis.wait_replicas`): a write counts as done once that many
//! replicas of the primary that took it confirmed it, so that a failover to one of them
//! cannot lose it. Redis replicates asynchronously; `WAIT` is how a client learns what
//! the replicas hold.
//!
//! `WAIT` covers the writes made *on the connection it is sent on*, up to that point (the
//! server keeps one write offset per client connection). Hence:
//! - It rides at the end of the very pipeline that carried the writes, after
//!   `CLIENT INFO` (which connection that was): one round trip, and no reconnect can slip
//!   in between the writes and the wait. On a cluster each primary written to gets its
//!   own pipeline and its own `WAIT`. (redis-rs 1.8 routes a bare `WAIT` to every
//!   primary and keeps the least answer: it would also block on primaries the batch
//!   never wrote to, and could not tell a node connection that was reopened meanwhile.)
//! - A retry ([`Store::wait_durable`]) asks `CLIENT INFO` and `WAIT` again, routed to
//!   the same primaries. The client library reconnects on its own after an error, and a
//!   `WAIT` on a new connection covers nothing written on the old one: it would confirm
//!   at once and prove nothing. So when the connection changed the answer is
//!   [`Replication::Replaced`], and the caller applies the batch again, in order (what a
//!   redelivery after a crash does anyway).
//!   (Redis 7.0.15, measured here, is more generous: a `WAIT` after any command covers
//!   every earlier write of the server. The documented contract is per connection, and
//!   that is all this relies on.)
//! - `WAIT` holds up every later call on its connection until it returns: a store that
//!   waits should have a connection of its own (`app.rs` opens one for ingest and one
//!   for the HTTP API, so dispatch never queues behind a `WAIT`).
//! - Without durability (`wait_replicas = 0`) neither `WAIT` nor `CLIENT INFO` is sent.

use super::call::{Ack, Call, Durability, Route};
use super::{Store, StoreError};

/// What the replicas confirmed of a batch's writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replication {
    /// No `WAIT` was sent: the store has no durability set, or nothing was written.
    NotAsked,
    /// At least the wanted replicas hold every write (`replicas`: the least count over
    /// the primaries written to).
    Confirmed { replicas: u32 },
    /// Fewer replicas than wanted confirmed within the timeout. The writes are applied;
    /// [`Store::wait_durable`] with `mark` asks again.
    Short { replicas: u32, mark: WriteMark },
    /// The connection that made the writes is gone, so no `WAIT` can cover them any
    /// more: apply the batch again, then wait.
    Replaced,
}

/// Where a batch's writes went: per primary (route), the connection that carried them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteMark {
    nodes: Vec<(Option<Route>, String)>,
}

impl Store {
    /// Makes every job write of this store wait for `durability`'s replicas (`None`: no
    /// waiting, no extra command). [`Store::apply`], [`Store::put`], [`Store::delete`]
    /// and [`Store::put_recurring`] then fail with [`StoreError::NotReplicated`] when the
    /// replicas fall short; [`Store::apply_batch`] reports it instead.
    pub fn with_durability(mut self, durability: Option<Durability>) -> Self {
        self.durability = durability;
        self
    }

    pub fn durability(&self) -> Option<Durability> {
        self.durability
    }

    /// Waits again for the writes of `mark` (a [`Replication::Short`] answer):
    /// [`Replication::Replaced`] if a connection that made them is gone.
    pub async fn wait_durable(&self, mark: &WriteMark) -> Result<Replication, StoreError> {
        let Some(want) = self.durability else {
            return Ok(Replication::NotAsked);
        };
        let mut routes: Vec<&Route> = Vec::new();
        for route in mark.nodes.iter().filter_map(|(route, _)| route.as_ref()) {
            if !routes.contains(&route) {
                routes.push(route);
            }
        }
        // On a standalone Redis (no routes) the bare pipeline goes to the one server.
        let probes: Vec<Call> = routes.into_iter().map(|route| self.probe(route)).collect();
        let (_, acks) = self.exec.run_waiting(&probes, &want).await?;
        let same_connections = mark.nodes.iter().all(|(route, connection)| {
            acks.iter()
                .any(|ack| ack.route == *route && ack.connection == *connection)
        });
        if !same_connections {
            return Ok(Replication::Replaced);
        }
        Ok(judge(want, acks))
    }

    /// A read that routes a pipeline to the primary of `route`: a key under the topic's
    /// hash tag, or the topic set (the one key a batch writes outside any topic).
    fn probe(&self, route: &Route) -> Call {
        let mut cmd = redis::cmd("TYPE");
        match route {
            Route::Topic(topic) => {
                let [scheduled, ..] = &self.keys.topic(topic).0;
                cmd.arg(scheduled);
                Call::on_topic(topic, cmd)
            }
            Route::Global => {
                cmd.arg(self.keys.topics());
                Call::global(cmd)
            }
        }
    }

    /// One write, `WAIT`ed for as `want` says: its reply, or
    /// [`StoreError::NotReplicated`] when the replicas fall short (the write stands).
    /// `what` names the call in an error.
    pub(super) async fn write_waiting(
        &self,
        what: &'static str,
        call: Call,
        want: Durability,
    ) -> Result<redis::Value, StoreError> {
        let (mut replies, acks) = self.exec.run_waiting(&[call], &want).await?;
        self.demand(judge(want, acks))?;
        Ok(replies
            .pop()
            .ok_or_else(|| StoreError::bad_reply(what, "no reply"))??)
    }

    /// `Ok` unless the replicas fell short: for callers that answer someone at once
    /// (HTTP, CLI) rather than hold on to the batch.
    pub(super) fn demand(&self, replication: Replication) -> Result<(), StoreError> {
        let Some(want) = self.durability else {
            return Ok(());
        };
        let confirmed = match replication {
            Replication::NotAsked | Replication::Confirmed { .. } => return Ok(()),
            Replication::Short { replicas, .. } => replicas,
            Replication::Replaced => 0,
        };
        Err(StoreError::NotReplicated {
            wanted: want.replicas,
            confirmed,
            timeout_ms: u64::try_from(want.timeout.as_millis()).unwrap_or(u64::MAX),
        })
    }
}

/// The verdict over a waiting batch's acks: the least replica count of the primaries
/// written to decides.
pub(super) fn judge(want: Durability, acks: Vec<Ack>) -> Replication {
    let Some(replicas) = acks.iter().map(|ack| ack.replicas).min() else {
        return Replication::NotAsked;
    };
    if replicas >= want.replicas {
        return Replication::Confirmed { replicas };
    }
    Replication::Short {
        replicas,
        mark: WriteMark {
            nodes: acks
                .into_iter()
                .map(|ack| (ack.route, ack.connection))
                .collect(),
        },
    }
}

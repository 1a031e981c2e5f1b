//! Partitioned commands (`amqp.command_partitions` > 1): the router (`route.rs`), one
//! lane per partition (`lane.rs`), the partitions shared out among the bridges announced
//! in the store, and the drain of a previous topology's queues before a changed count is
//! consumed (the book's *Partitioned commands*, `docs/src/partitions.md`).

use std::time::Duration;

use lapin::Connection;
use tokio_util::sync::CancellationToken;

use super::lane::{Lane, Share};
use super::route::{route_commands, Routed};
use super::{store_error, Ingest};
use crate::amqp::{self, AmqpError};
use crate::store::{RecordedPartitions, Store};

/// Between looks at a previous topology's queue, the drain waits this long.
const DRAIN_POLL: Duration = Duration::from_secs(1);

/// How long an ingest announcement lives, and how often each bridge renews it.
const MEMBER_TTL_MS: u64 = 5_000;
const MEMBER_REFRESH: Duration = Duration::from_secs(1);

/// This process's name among the ingest members: pid and start time.
fn member_name() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{:x}", std::process::id(), nanos)
}

/// Which of the partitions are `me`'s share among `members`: each goes to the member
/// with the highest hash of (member, partition). A stable hash (FNV-1a, then a
/// finaliser), so every bridge, whatever its build, computes the same shares.
fn shared_out(members: &[String], me: &str, partitions: u16) -> Vec<bool> {
    fn score(member: &str, k: u16) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in member.bytes().chain(k.to_le_bytes()) {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }
    (0..partitions)
        .map(|k| {
            members
                .iter()
                .max_by_key(|m| (score(m, k), m.as_str()))
                .is_none_or(|owner| owner == me)
        })
        .collect()
}

impl Ingest {
    /// The command partitions' lanes (`amqp.command_partitions` > 1) until shutdown or
    /// a broker error, and this bridge's announcement among the ingest members.
    pub(super) async fn run_partitioned(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
        partitions: u16,
    ) -> Result<(), AmqpError> {
        // The partitions are shared out among the bridges announced in the store
        // (rendezvous hashing: each partition to the member whose hash with it is
        // highest, so a bridge joining or leaving moves only its own share). Until the
        // first announcement this bridge counts as owning every partition.
        // Said at every session: partitioned ingest is young, and one long chaos run
        // lost jobs for a reason never found (docs/src/partitions.md).
        tracing::warn!(
            partitions,
            "command partitions are young: the 30-minute fault-injection run now keeps every \
             job, but an earlier one lost jobs whose commands were applied, cause not found \
             (docs/src/partitions.md, Partitioned commands); amqp.command_partitions = 1 is the proven choice"
        );
        let member = member_name();
        let (owned_tx, owned) = tokio::sync::watch::channel(vec![true; usize::from(partitions)]);
        let lanes: Vec<Lane> = (0..partitions)
            .map(|k| Lane {
                queue: amqp::partition_queue(&self.config.amqp, k),
                store: self.store.for_partition(k),
                drain: false,
                share: Some(Share::new(k, owned.clone())),
            })
            .collect();
        let consuming = futures_util::future::try_join(
            futures_util::future::try_join_all(
                lanes
                    .iter()
                    .map(|lane| self.run_partition(connection, shutdown, lane)),
            ),
            self.run_router(connection, shutdown),
        );
        let result = tokio::select! {
            result = consuming => result.map(|_| ()),
            () = self.share_out(&member, partitions, owned_tx) => Ok(()),
        };
        // Best effort: the others take this bridge's share at once, not when it expires
        // (its announcement lapses by itself if this fails).
        match tokio::time::timeout(Duration::from_secs(1), self.store.leave_ingest(&member)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::debug!(%error, "could not withdraw from the ingest members"),
            Err(_) => tracing::debug!("withdrawing from the ingest members timed out"),
        }
        result
    }

    /// The router (`route.rs`) until shutdown or a broker error: one active in the
    /// deployment at a time (the route queue has a single active consumer), the others
    /// waiting behind it.
    async fn run_router(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
    ) -> Result<(), AmqpError> {
        let cfg = &self.config.amqp;
        loop {
            let careful = self.isolation.careful();
            let routed = route_commands(
                connection,
                cfg,
                self.config.ingest.prefetch,
                careful,
                shutdown,
            )
            .await;
            match routed {
                Ok(Routed::Shutdown) => return Ok(()),
                Ok(Routed::Recovered) => {
                    let ended = self.isolation.recovered();
                    tracing::info!(queue = %amqp::route_queue(cfg), sessions_ended = ended, "the unparseable message is no longer at the head of the route queue; routing at the normal window again");
                }
                Err(err) if err.is_unparseable() => {
                    self.isolation.isolate(cfg, &amqp::route_queue(cfg), &err);
                    return Err(err);
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Announces this bridge's ingest every [`MEMBER_REFRESH`] and publishes which
    /// partitions are its share among the members announced; runs until dropped.
    async fn share_out(
        &self,
        member: &str,
        partitions: u16,
        owned: tokio::sync::watch::Sender<Vec<bool>>,
    ) {
        let mut bridges = 0;
        loop {
            match self.store.ingest_members(member, MEMBER_TTL_MS).await {
                Ok(members) => {
                    let share = shared_out(&members, member, partitions);
                    if members.len() != bridges || *owned.borrow() != share {
                        bridges = members.len();
                        let mine = share.iter().filter(|o| **o).count();
                        tracing::info!(
                            bridges,
                            partitions,
                            mine,
                            "command partitions shared out anew"
                        );
                    }
                    owned.send_if_modified(|current| {
                        if *current == share {
                            return false;
                        }
                        *current = share;
                        true
                    });
                }
                Err(err) => {
                    tracing::debug!(error = %err, "could not announce this bridge's ingest; the partitions stay shared out as they were");
                }
            }
            tokio::time::sleep(MEMBER_REFRESH).await;
        }
    }

    /// One partition's lane until shutdown: a session that ended without an error (it
    /// was fenced, or gave a batch up) consumes again on a new channel, so the other
    /// partitions this bridge holds are not handed over with it; an error ends them all.
    async fn run_partition(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
        lane: &Lane,
    ) -> Result<(), AmqpError> {
        while !shutdown.is_cancelled() {
            self.run_lane(connection, shutdown, lane).await?;
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
        Ok(())
    }

    /// The queues of the previous topology, after unbinding them from the commands
    /// exchange (so they receive no new command), in the stages they are drained in:
    /// the one commands queue when this bridge is partitioned; the partitions, then the
    /// route queue (whose commands are newer than any it forwarded) when not. The store
    /// records the topology ingest last switched to (see [`Ingest::run`]), so a bridge
    /// whose count matches it probes nothing. A count that changed between two values
    /// above 1 cannot keep a job's order (both topologies use the same queue names):
    /// refused, go through 1; so are the partitions of the release before (hashed by the
    /// consistent-hash exchange, not by the router).
    pub(super) async fn previous_topology(
        &self,
        connection: &Connection,
    ) -> Result<Vec<Vec<Lane>>, AmqpError> {
        let cfg = &self.config.amqp;
        let partitions = cfg.command_partitions;
        let recorded = self.store.command_partitions().await.map_err(store_error)?;
        let lane = |queue: String, store: Store| Lane {
            queue,
            store,
            drain: true,
            share: None,
        };
        match recorded {
            RecordedPartitions::One if partitions <= 1 => Ok(Vec::new()),
            RecordedPartitions::Routed(n) if n == partitions => Ok(Vec::new()),
            RecordedPartitions::One => {
                if amqp::queue_state(connection, &cfg.commands_queue)
                    .await?
                    .is_none()
                {
                    return Ok(Vec::new());
                }
                amqp::unbind_commands_queue(connection, cfg, &cfg.commands_queue).await?;
                Ok(vec![vec![lane(
                    cfg.commands_queue.clone(),
                    self.store.clone(),
                )]])
            }
            _ if partitions > 1 => Err(AmqpError::Topology(refused(recorded, partitions))),
            RecordedPartitions::Hashed(n) | RecordedPartitions::Routed(n) => {
                let route = amqp::route_queue(cfg);
                if matches!(recorded, RecordedPartitions::Hashed(_)) {
                    amqp::unbind_hash_exchange(connection, cfg).await?;
                } else {
                    amqp::unbind_commands_queue(connection, cfg, &route).await?;
                }
                let mut stages = vec![(0..n)
                    .map(|k| lane(amqp::partition_queue(cfg, k), self.store.for_partition(k)))
                    .collect()];
                if matches!(recorded, RecordedPartitions::Routed(_)) {
                    stages.push(vec![lane(route, self.store.clone())]);
                }
                Ok(stages)
            }
        }
    }

    /// Drains a queue of the previous topology: consumes it (a lane that ends once idle)
    /// while it holds commands nobody consumes, and deletes it once two looks
    /// [`DRAIN_POLL`] apart found it with no ready command and no consumer. A command
    /// handed to a consumer and not yet acked keeps that consumer in the queue (and goes
    /// back to ready if the consumer goes), so then every command it held was applied
    /// and acked before this bridge consumes the new topology. While another bridge
    /// still consumes it (one configured the old way), it waits.
    pub(super) async fn drain(
        &self,
        connection: &Connection,
        shutdown: &CancellationToken,
        lane: &Lane,
    ) -> Result<(), AmqpError> {
        let mut waiting_logged = false;
        let mut empty_looks = 0;
        while !shutdown.is_cancelled() {
            let Some((ready, consumers)) = amqp::queue_state(connection, &lane.queue).await? else {
                return Ok(());
            };
            if consumers == 0 && ready > 0 {
                empty_looks = 0;
                tracing::info!(queue = %lane.queue, ready, "applying the commands left in the previous topology's queue before consuming the new one");
                self.run_lane(connection, shutdown, lane).await?;
                continue;
            }
            if consumers == 0 && ready == 0 {
                empty_looks += 1;
                if empty_looks >= 2 {
                    amqp::delete_queue(connection, &lane.queue).await?;
                    tracing::info!(queue = %lane.queue, "the previous topology's commands queue is drained; deleted it");
                    return Ok(());
                }
            } else {
                empty_looks = 0;
                if !waiting_logged {
                    tracing::warn!(queue = %lane.queue, ready, partitions = self.config.amqp.command_partitions,
                        "amqp.command_partitions changed: waiting for the previous topology's commands queue to drain (another bridge still consumes it) before consuming the new one; new commands wait in the new queues meanwhile");
                    waiting_logged = true;
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(DRAIN_POLL) => {}
            }
        }
        Ok(())
    }
}

/// Why a partitioned bridge refuses the recorded topology.
fn refused(recorded: RecordedPartitions, partitions: u16) -> String {
    match recorded {
        RecordedPartitions::Hashed(n) => format!(
            "amqp.command_partitions = {partitions} but this deployment's commands are partitioned {n} ways by the release before (through RabbitMQ's consistent-hash exchange, which moves ids at a broker restart): set amqp.command_partitions = 1 on every bridge first (they drain the old partitions), then {partitions} (docs/src/partitions.md)"
        ),
        _ => format!(
            "amqp.command_partitions = {partitions} but this deployment's commands are partitioned {} ways: change the count through amqp.command_partitions = 1 (docs/src/partitions.md)",
            recorded.count()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::shared_out;

    fn owners(members: &[String], partitions: u16) -> Vec<usize> {
        (0..partitions)
            .map(|k| {
                let owning: Vec<usize> = members
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| shared_out(members, m, partitions)[usize::from(k)])
                    .map(|(i, _)| i)
                    .collect();
                assert_eq!(owning.len(), 1, "partition {k} owned by {owning:?}");
                owning[0]
            })
            .collect()
    }

    #[test]
    fn every_partition_has_exactly_one_owner_and_a_new_member_takes_only_its_share() {
        let members: Vec<String> = (0..3).map(|i| format!("bridge-{i}")).collect();
        let before = owners(&members, 64);
        for i in 0..3 {
            let share = before.iter().filter(|o| **o == i).count();
            assert!((8..=40).contains(&share), "bridge {i} owns {share} of 64");
        }
        let mut more = members.clone();
        more.push("bridge-3".into());
        let after = owners(&more, 64);
        for (k, (b, a)) in before.iter().zip(&after).enumerate() {
            assert!(a == b || *a == 3, "partition {k} moved from {b} to {a}");
        }
        assert!(after.contains(&3), "the new member got nothing");
        // A member alone owns everything; no member: everything counts as one's own.
        assert!(shared_out(&members[..1], &members[0], 8).iter().all(|o| *o));
        assert!(shared_out(&[], "anyone", 8).iter().all(|o| *o));
    }
}

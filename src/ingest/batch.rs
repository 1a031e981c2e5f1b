//! Applying one batch to the store, the one place a command is decoded: the Redis
//! server's clock read first if a put in the batch names a cron series (one `TIME`),
//! each delivery decoded once into its command (`decode/`), the commands applied
//! fenced by the session's epoch, retried while Redis is unreachable (never once the
//! batch's channel closed), and held unacked until `redis.wait_replicas` replicas
//! confirmed them. A `delete-prefix` is a batch of its own.

use std::time::{Duration, Instant};

use lapin::Channel;
use tokio_util::sync::CancellationToken;

use super::decode::{decode_command, decode_prefix_delete, Invalid, Received, Rules};
use super::Ingest;
use crate::amqp;
use crate::job::{IdPrefix, Topic};
use crate::store::{Applied, Command, RejectCode, Rejection, Replication, Store, StoreError};

/// An ingest session's epoch (see the store's batch apply): the session part comes from
/// the store's counter at the first batch, when this consumer became the active one, so
/// it is newer than every session active before (once [`still_ours`] confirmed it); the
/// attempt part grows after each failed apply, so the retry outranks a request of this
/// session still on its way, but never a later session (a stale session's retries stay
/// below the session that took over its commands).
#[derive(Default)]
pub(super) struct Epoch(tokio::sync::Mutex<Option<(u64, u64)>>);

/// Attempts per session before the session part must change (then it takes a new one).
const EPOCH_ATTEMPTS: u64 = 1_000_000;

/// An epoch to write with, and whether its session part was just taken from the store
/// (then [`still_ours`] asks the broker before it is used).
pub(super) struct Taken {
    pub epoch: u64,
    pub fresh: bool,
}

impl Epoch {
    pub(super) async fn get(&self, store: &Store) -> Result<Taken, StoreError> {
        let mut current = self.0.lock().await;
        let ((session, attempt), fresh) = match *current {
            Some(parts) if parts.1 < EPOCH_ATTEMPTS => (parts, false),
            _ => ((store.next_ingest_epoch().await?, 0), true),
        };
        *current = Some((session, attempt));
        Ok(Taken {
            epoch: session * EPOCH_ATTEMPTS + attempt,
            fresh,
        })
    }

    /// After an apply with `used` failed: the next one writes with a higher attempt.
    pub(super) async fn expire(&self, used: u64) {
        let mut current = self.0.lock().await;
        if let Some((session, attempt)) = current.as_mut() {
            if *session * EPOCH_ATTEMPTS + *attempt == used {
                *attempt += 1;
            }
        }
    }
}

/// A batch as applied: its deliveries, for each whether it decoded (or why it is
/// invalid), the valid ones' commands and the store's result for each, in order.
pub(super) struct AppliedBatch {
    /// Each delivery with what it names, in order.
    pub batch: Vec<Received>,
    pub commands: Vec<Result<(), Invalid>>,
    /// The valid commands, in order.
    pub ops: Vec<Command>,
    pub results: Vec<Result<Applied, Rejection>>,
    /// A `delete-prefix` batch (its one delivery): how many jobs went, or why not.
    pub prefix: Option<Result<u64, Invalid>>,
}

/// What applying a session's batches needs: the lane's store (whose fence its writes
/// use), the channel they came on, the session's epoch, the rules commands are decoded
/// by. Shared by the session's batches in flight.
pub(super) struct Apply<'a> {
    pub ingest: &'a Ingest,
    pub store: &'a Store,
    pub channel: Channel,
    pub epoch: Epoch,
    pub rules: Rules,
    pub shutdown: &'a CancellationToken,
}

impl Apply<'_> {
    /// Decodes and applies a batch taken; several may run at once. `None`: shutdown
    /// came, or the consumer channel closed, while Redis was unreachable, or the session
    /// was superseded (fenced); the batch stays unacked and is redelivered.
    pub(super) async fn batch(&self, batch: Vec<Received>) -> Option<AppliedBatch> {
        if let [received] = batch.as_slice() {
            if received.is_prefix_delete() {
                let delivery = &received.delivery;
                let key = delivery.routing_key.as_str();
                let prefix = match decode_prefix_delete(key, &delivery.properties) {
                    Ok((topic, prefix)) => self.prefix(&topic, &prefix).await?,
                    Err(invalid) => Err(invalid),
                };
                return Some(AppliedBatch {
                    batch,
                    commands: Vec::new(),
                    ops: Vec::new(),
                    results: Vec::new(),
                    prefix: Some(prefix),
                });
            }
        }
        // A cron series' first occurrence is placed on the Redis server's clock, the one
        // every due time refers to: read once, before decoding, for a batch that has one.
        let now = if batch.iter().any(|r| r.envelope.needs_clock) {
            Some(self.until_done(|| self.store.server_time()).await?)
        } else {
            None
        };
        let targets = &self.ingest.config.targets;
        let mut ops: Vec<Command> = Vec::with_capacity(batch.len());
        let commands: Vec<Result<(), Invalid>> = batch
            .iter()
            .map(|r| decode_command(&r.delivery, self.rules, targets, now).map(|c| ops.push(c)))
            .collect();
        let sent = Instant::now();
        let (results, replication) = self.until_done(|| self.apply(&ops)).await.flatten()?;
        if let Some(fenced) = first_fenced(&results) {
            // Another bridge took over these commands' topics (our deliveries went back
            // to the broker): end the session, acking nothing; what this batch applied
            // is applied again, in order, wherever the broker redelivers it.
            tracing::warn!(reason = %fenced, "this ingest session was superseded; reconnecting");
            return None;
        }
        if !self.until_replicated(&ops, replication, sent).await {
            return None;
        }
        Some(AppliedBatch {
            batch,
            commands,
            ops,
            results,
            prefix: None,
        })
    }

    /// Applies a `delete-prefix` alone (every batch before it is acked, none after it
    /// started), fenced like puts and deletes. `None` as for [`Apply::batch`].
    async fn prefix(&self, topic: &Topic, prefix: &IdPrefix) -> Option<Result<u64, Invalid>> {
        let (store, epoch) = (self.store, &self.epoch);
        let fenced = self.ingest.config.amqp.single_active_consumer;
        let outcome = self
            .until_done(|| async {
                let used = if fenced {
                    let taken = epoch.get(store).await?;
                    if !still_ours(&self.channel, &taken).await {
                        return Ok(None);
                    }
                    Some(taken.epoch)
                } else {
                    None
                };
                match store.delete_prefix(topic, prefix, used).await {
                    Ok(n) => Ok(Some(Ok(n))),
                    Err(StoreError::Rejected(rejection)) => Ok(Some(Err(rejection))),
                    Err(err) => {
                        if let Some(used) = used {
                            epoch.expire(used).await;
                        }
                        Err(err)
                    }
                }
            })
            .await
            .flatten()?;
        match outcome {
            Ok(n) => {
                tracing::info!(%topic, id_prefix = %prefix, deleted = n, "jobs cancelled by id prefix");
                Some(Ok(n))
            }
            Err(rejection) if rejection.code == RejectCode::Fenced => {
                tracing::warn!(reason = %rejection, "this ingest session was superseded; reconnecting");
                None
            }
            Err(rejection) => Some(Err(Invalid(rejection.to_string()))),
        }
    }

    /// Applies commands, fenced by the session's epoch while the commands queue has a
    /// single active consumer (with several active consumers order is not promised,
    /// and they would fence each other); with `redis.wait_replicas`, says what the
    /// replicas confirmed.
    ///
    /// `Ok(None)`: not applied, because the channel closed while the epoch was taken.
    async fn apply(
        &self,
        ops: &[Command],
    ) -> Result<Option<(Vec<Result<Applied, Rejection>>, Replication)>, StoreError> {
        if !self.ingest.config.amqp.single_active_consumer {
            return self.store.apply_batch(ops, None).await.map(Some);
        }
        let taken = self.epoch.get(self.store).await?;
        if !still_ours(&self.channel, &taken).await {
            return Ok(None);
        }
        let used = taken.epoch;
        let result = self.store.apply_batch(ops, Some(used)).await;
        if result.is_err() {
            // The request may still reach Redis later over the old connection: the
            // retry writes with a newer epoch, so that late arrival is refused.
            self.epoch.expire(used).await;
        }
        result.map(Some)
    }

    /// Retries a store call while Redis is unreachable: a command is never acked before
    /// it was applied, so an outage stalls intake instead of losing commands. `None` on
    /// shutdown, or once the channel the batch came on is closed: the broker has
    /// taken the batch back and may have given it to another bridge, which may have
    /// applied it and the commands after it, so applying it here now could undo a later
    /// delete or replace (found by `tests/chaos.rs`; `tests/faults/bridge_faults.rs`,
    /// `a_bridge_that_lost_its_batch_does_not_apply_it_later`).
    async fn until_done<T, F, Fut>(&self, mut call: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut backoff = Duration::from_millis(100);
        loop {
            if !self.channel.status().connected() {
                tracing::warn!("commands channel closed while Redis was unavailable; the broker redelivers the batch, it is not applied here");
                return None;
            }
            match call().await {
                Ok(results) => {
                    return Some(results);
                }
                Err(err) => {
                    let level_error = !matches!(
                        err,
                        StoreError::Unavailable(_) | StoreError::NotReplicated { .. }
                    );
                    if level_error {
                        tracing::error!(error = %err, "store failed a command batch; retrying");
                    } else {
                        tracing::warn!(error = %err, retry_in = ?backoff, "redis unavailable; commands wait");
                    }
                }
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return None,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Holds an applied batch, unacked, until `redis.wait_replicas` replicas confirmed
    /// its writes: asks again after a pause (the `WAIT` itself blocks up to
    /// `redis.wait_timeout_ms`), and applies the batch again, in order, when the
    /// connection that wrote it was replaced (the outcomes of the first application stand).
    /// Never nacks: a requeued command counts towards the queue's delivery limit and
    /// would be dead-lettered while valid. `false` on shutdown, once the channel closed (the
    /// broker took the batch back: see [`Apply::until_done`]), or when the re-applied
    /// batch was fenced: the batch stays unacked and is redelivered.
    async fn until_replicated(
        &self,
        commands: &[Command],
        mut replication: Replication,
        sent: Instant,
    ) -> bool {
        let ingest = self.ingest;
        let (wanted, timeout_ms) = (
            ingest.config.redis.wait_replicas,
            ingest.config.redis.wait_timeout_ms,
        );
        let mut pause = Duration::from_millis(100);
        let mut held = false;
        loop {
            let mark = match replication {
                Replication::NotAsked => return true,
                Replication::Confirmed { replicas } => {
                    ingest
                        .metrics
                        .replication_wait
                        .observe(sent.elapsed().as_secs_f64());
                    if held {
                        tracing::info!(replicas, waited = ?sent.elapsed(), "replicas confirmed the held command batch; acking it");
                    }
                    return true;
                }
                Replication::Short { replicas, mark } => {
                    ingest.metrics.replication_shortfall("timeout");
                    let detail =
                        format!("{replicas} of {wanted} replicas confirmed within {timeout_ms} ms");
                    if ingest
                        .warnings
                        .admit("*", "command batches held for replicas", &detail)
                    {
                        tracing::warn!(replicas, wanted, timeout_ms, "command batch applied but not acked: too few replicas confirmed it (redis.wait_replicas); holding it and asking again");
                    }
                    Some(mark)
                }
                Replication::Replaced => {
                    ingest.metrics.replication_shortfall("connection_replaced");
                    tracing::warn!("the Redis connection that wrote the held command batch was replaced; applying the batch again before waiting");
                    None
                }
            };
            held = true;
            tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(1));
            let next = match &mark {
                Some(mark) => self.until_done(|| self.store.wait_durable(mark)).await,
                None => match self.until_done(|| self.apply(commands)).await.flatten() {
                    Some((results, _)) if first_fenced(&results).is_some() => {
                        tracing::warn!("this ingest session was superseded while its batch waited for replicas; reconnecting");
                        return false;
                    }
                    applied => applied.map(|(_, replication)| replication),
                },
            };
            let Some(next) = next else {
                return false;
            };
            replication = next;
        }
    }
}

/// The first command of a batch refused because a newer ingest epoch wrote its topic.
fn first_fenced(results: &[Result<Applied, Rejection>]) -> Option<&Rejection> {
    results.iter().find_map(|result| match result {
        Err(rejection) if rejection.code == RejectCode::Fenced => Some(rejection),
        _ => None,
    })
}

/// Whether `channel`, the one a batch came on, is still open, checked after the epoch
/// was taken. Taking a session part is a Redis round trip that a slow link can stretch:
/// had the broker given the batch to another bridge meanwhile, that bridge may have
/// applied it and later commands with an *older* epoch (it became active before this
/// epoch was issued), and this batch, written with the newer one, would win over them
/// (found by `tests/chaos.rs` with command partitions: a replace lost). The client's view
/// of the channel lags the broker's (a stalled link is noticed only at the heartbeat
/// timeout), so a fresh session part is confirmed by a round trip on the channel: if
/// the broker still has it open after the epoch was issued, no other bridge has had
/// these deliveries yet, and any that gets them later takes a newer epoch.
pub(super) async fn still_ours(channel: &Channel, taken: &Taken) -> bool {
    channel.status().connected() && (!taken.fresh || amqp::channel_confirmed_open(channel).await)
}

//! The bookkeeping floor of the webhook throughput figure: the plain client's requests
//! plus the least Redis work any dispatcher that keeps each job in Redis must do for it,
//! and nothing else. It answers "how close to the plain client can a Redis-backed
//! dispatcher get on this machine at all?", so the bridge's ratio can be read against
//! what is reachable, not only against a client that keeps no state.
//!
//! Per job, in calls of up to 64, from this process with the bridge's Redis library:
//! take it (`ZRANGEBYSCORE` + `ZREM` from the schedule, `ZADD` to a lease index,
//! `HMGET` of its record), POST its body with the plain client's headers, then settle
//! it (`ZREM` + `HDEL`, and one history entry per job, `LPUSH` + `LTRIM`). No record is
//! parsed or rewritten, no attempt or token is kept, no rate limit, pause or expiry is
//! looked at: everything redisched's scripts do beyond that is left out on purpose.
//! Slots work as the bridge's target does: `max_in_flight` requests at once, a slot free
//! at the answer, a take once a quarter of the slots (at most 16) is free.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use redis::aio::MultiplexedConnection;
use tokio::sync::{mpsc, Semaphore};

use super::common;
use super::plain_http::like_the_bridge;

/// Jobs per call, as the bridge's largest webhook take.
const CALL: usize = 64;

/// Takes up to ARGV[2] jobs due by ARGV[1], leases them until ARGV[3], returns
/// `{ ids, records }`. The commands of redisched's reserve.lua, without its per-job Lua.
const TAKE: &str = r"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
if #ids == 0 then return { {}, {} } end
redis.call('ZREM', KEYS[1], unpack(ids))
local index = {}
for i, id in ipairs(ids) do index[2 * i - 1] = ARGV[3]; index[2 * i] = id end
redis.call('ZADD', KEYS[2], unpack(index))
return { ids, redis.call('HMGET', KEYS[3], unpack(ids)) }
";

/// Settles ARGV[1] = n jobs: ARGV[2..n+1] ids, then n history entries. The commands of
/// redisched's release.lua, without its per-job Lua.
const SETTLE: &str = r"
local n = tonumber(ARGV[1])
local ids = { unpack(ARGV, 2, n + 1) }
redis.call('ZREM', KEYS[2], unpack(ids))
redis.call('HDEL', KEYS[3], unpack(ids))
redis.call('LPUSH', KEYS[4], unpack(ARGV, n + 2, 2 * n + 1))
redis.call('LTRIM', KEYS[4], 0, 999)
return n
";

/// The floor's own keys (one hash slot), deleted by [`Keys::delete`].
pub(super) struct Keys([String; 4]);

impl Keys {
    pub(super) fn new(prefix: &str) -> Self {
        let tag = format!("{prefix}:floor:{{f}}");
        Self([
            format!("{tag}:scheduled"),
            format!("{tag}:reserved"),
            format!("{tag}:jobs"),
            format!("{tag}:history"),
        ])
    }

    pub(super) async fn delete(&self, redis: &mut MultiplexedConnection) -> Result<()> {
        let _: () = redis::cmd("DEL")
            .arg(&self.0[..])
            .query_async(redis)
            .await
            .context("delete the floor's keys")?;
        Ok(())
    }
}

/// Loads `n` due jobs as redisched stores them (a format-1 record: 40 bytes of meta,
/// then `body`), times the pass from the first take until every job is settled.
pub(super) async fn pass(
    redis: &MultiplexedConnection,
    keys: &Keys,
    client: &reqwest::Client,
    url: &str,
    n: u64,
    max_in_flight: usize,
    body: &[u8],
) -> Result<Duration> {
    let mut con = redis.clone();
    keys.delete(&mut con).await?;
    load(&mut con, keys, n, body).await?;
    let take = redis::Script::new(TAKE);
    let slots = Arc::new(Semaphore::new(max_in_flight));
    let quarter = redisched::dispatch::slots_worth_a_reserve(max_in_flight);
    let (answered, mut answers) = mpsc::unbounded_channel::<(String, u16)>();
    let started = Instant::now();
    let settler = {
        let (mut con, history) = (redis.clone(), keys.0.clone());
        tokio::spawn(async move {
            let settle = redis::Script::new(SETTLE);
            let mut settled = 0u64;
            let mut batch = Vec::with_capacity(CALL);
            while settled < n {
                match answers.recv().await {
                    Some(first) => batch.push(first),
                    None => bail!("the floor's requests ended after {settled} of {n}"),
                }
                while batch.len() < CALL {
                    match answers.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let now = (common::now_us() / 1000).to_string();
                let mut call = settle.prepare_invoke();
                call.key(&history[..]).arg(batch.len());
                for (id, _) in &batch {
                    call.arg(id);
                }
                for (id, status) in &batch {
                    call.arg(format!(
                        "{now}|dispatched|1|{now}|{}|{id}HTTP {status}",
                        id.len()
                    ));
                }
                let count: u64 = call.invoke_async(&mut con).await.context("settle")?;
                settled += count;
                batch.clear();
            }
            Ok(())
        })
    };
    let (mut taken, mut sent) = (0u64, 0u64);
    while taken < n {
        let mut room = slots
            .clone()
            .acquire_many_owned(quarter as u32)
            .await
            .context("slots")?;
        while room.num_permits() < CALL {
            match slots.clone().try_acquire_owned() {
                Ok(one) => room.merge(one),
                Err(_) => break,
            }
        }
        let deadline = (common::now_us() / 1000 + 60_000).to_string();
        let (ids, records): (Vec<String>, Vec<Option<Vec<u8>>>) = take
            .key(&keys.0[..])
            .arg(common::now_us() / 1000)
            .arg(room.num_permits())
            .arg(deadline)
            .invoke_async(&mut con)
            .await
            .context("take")?;
        if ids.is_empty() {
            bail!("the floor found nothing due after {taken} of {n}");
        }
        taken += ids.len() as u64;
        for (id, record) in ids.into_iter().zip(records) {
            let one = room
                .split(1)
                .context("a take returned more jobs than free slots")?;
            let body = payload(record)?;
            let (client, url, answered) = (client.clone(), url.to_string(), answered.clone());
            let headers = like_the_bridge(sent, &[]);
            sent += 1;
            tokio::spawn(async move {
                let status = match client.post(url).headers(headers).body(body).send().await {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let _ = response.bytes().await;
                        status
                    }
                    Err(_) => 0,
                };
                drop(one);
                let _ = answered.send((id, status));
            });
        }
    }
    drop(answered);
    settler.await.context("the settler")??;
    Ok(started.elapsed())
}

/// The job's body: its record after the format-1 header and the meta.
fn payload(record: Option<Vec<u8>>) -> Result<Vec<u8>> {
    let record = record.context("a taken job has no record")?;
    let header = record
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'|')
        .nth(4)
        .map(|(at, _)| at + 1)
        .context("a record without its header")?;
    Ok(record[header + META.len()..].to_vec())
}

const META: &[u8; 40] = b"0123456789abcdefghijklmnopqrstuvwxyzABCD";

async fn load(con: &mut MultiplexedConnection, keys: &Keys, n: u64, body: &[u8]) -> Result<()> {
    let due = common::now_us() / 1000 - 1_000;
    let mut from = 0;
    while from < n {
        let to = (from + 1_000).min(n);
        let mut pipe = redis::pipe();
        for i in from..to {
            let id = common::job_id("floor", i);
            let mut record = format!("1|{due}|0|0|{}|", META.len()).into_bytes();
            record.extend_from_slice(META);
            record.extend_from_slice(body);
            pipe.hset(&keys.0[2], &id, record).ignore();
            pipe.zadd(&keys.0[0], &id, due).ignore();
        }
        let _: () = pipe
            .query_async(con)
            .await
            .context("load the floor's jobs")?;
        from = to;
    }
    Ok(())
}

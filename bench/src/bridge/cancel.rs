//! Scenario 6 (cancel): deletes by id per second, through the Lua script
//! (`Store::apply` batches of `Op::Delete`) beside raw pipelined ZREM+HDEL on the same
//! Redis, and through AMQP delete commands (see `ingest.rs`, `Kind::Delete`).

use std::time::Instant;

use anyhow::{bail, Result};
use futures_util::{stream, StreamExt};
use redisched::job::{Due, JobId};
use redisched::store::Op;
use serde_json::{json, Value};

use super::common::{self, Cleanup, Env, Ticker};
use super::ingest;

pub(super) struct Params {
    pub deletes: u64,
    pub amqp_deletes: u64,
    pub body_bytes: usize,
}

pub(super) async fn run(env: &Env, params: &Params) -> Result<Value> {
    let lua = lua(env, params).await?;
    let amqp = ingest::run(
        env,
        ingest::Kind::Delete,
        &ingest::Params {
            commands: params.amqp_deletes,
            body_bytes: params.body_bytes,
            partitions: 1,
            bridges: 1,
        },
    )
    .await?;
    Ok(json!({ "lua": lua, "amqp": amqp }))
}

async fn lua(env: &Env, params: &Params) -> Result<Value> {
    let config = common::bench_config(env, "cancel-lua");
    let cleanup = Cleanup {
        queues: Vec::new(),
        exchanges: Vec::new(),
        ..Cleanup::for_config(&config)
    };
    eprintln!(
        "cancel (Lua): {} deletes by id (prefix {})",
        params.deletes, config.redis.prefix
    );
    let result = lua_measure(params, &config).await;
    cleanup.run().await;
    result
}

async fn lua_measure(params: &Params, config: &redisched::config::Config) -> Result<Value> {
    let n = params.deletes;
    let store = common::store(config).await?;
    let topic = common::topic("bench")?;
    let body = common::body(params.body_bytes);
    common::load_jobs(
        &store,
        &topic,
        "job",
        n,
        &body,
        Due::Delay(3_600_000),
        "load jobs",
    )
    .await?;
    let started = Instant::now();
    let batches: Vec<(u64, u64)> = (0..n)
        .step_by(1000)
        .map(|s| (s, (s + 1000).min(n)))
        .collect();
    let mut results = stream::iter(batches.into_iter().map(|(from, to)| {
        let store = &store;
        let topic = &topic;
        async move {
            let ops = (from..to)
                .map(|i| {
                    Ok(Op::Delete {
                        topic: topic.clone(),
                        id: JobId::new(common::job_id("job", i))?,
                    })
                })
                .collect::<Result<Vec<Op>>>()?;
            let applied = store.apply(&ops).await?;
            let removed = applied
                .iter()
                .filter(|r| matches!(r, Ok(redisched::store::Applied::Delete { removed: true })))
                .count() as u64;
            Ok::<u64, anyhow::Error>(removed)
        }
    }))
    .buffer_unordered(4);
    let mut removed = 0u64;
    let mut ticker = Ticker::new();
    while let Some(r) = results.next().await {
        removed += r?;
        if ticker.due() {
            common::progress("delete via delete.lua", removed, n, started);
        }
    }
    let lua_time = started.elapsed();
    common::progress_done("delete via delete.lua", removed, started);
    if removed != n {
        bail!("deleted {removed} of {n}");
    }
    let lua_rate = common::per_sec(n, lua_time);

    // Ceiling: the same deletes as raw commands on a sorted set and a hash.
    let client = redis::Client::open(config.redis.url.as_str())?;
    let conn = redis::aio::ConnectionManager::new(client).await?;
    let zset = format!("{}:raw:scheduled", config.redis.prefix);
    let hash = format!("{}:raw:jobs", config.redis.prefix);
    let chunks: Vec<(u64, u64)> = (0..n)
        .step_by(1000)
        .map(|s| (s, (s + 1000).min(n)))
        .collect();
    for &(from, to) in &chunks {
        let mut pipe = redis::pipe();
        for i in from..to {
            let id = common::job_id("job", i);
            pipe.zadd(&zset, &id, i as i64).ignore();
            pipe.hset(&hash, &id, &body[..]).ignore();
        }
        pipe.query_async::<()>(&mut conn.clone()).await?;
    }
    let started = Instant::now();
    let mut results = stream::iter(chunks.iter().map(|&(from, to)| {
        let mut conn = conn.clone();
        let (zset, hash) = (&zset, &hash);
        async move {
            let mut pipe = redis::pipe();
            for i in from..to {
                let id = common::job_id("job", i);
                pipe.zrem(zset, &id).ignore();
                pipe.hdel(hash, &id).ignore();
            }
            pipe.query_async::<()>(&mut conn).await?;
            Ok::<u64, anyhow::Error>(to - from)
        }
    }))
    .buffer_unordered(4);
    let mut done = 0;
    while let Some(r) = results.next().await {
        done += r?;
    }
    let raw_time = started.elapsed();
    common::progress_done("ceiling: raw ZREM+HDEL", done, started);
    let raw_rate = common::per_sec(n, raw_time);
    Ok(json!({
        "deletes": n,
        "pipeline": 1000,
        "in_flight": 4,
        "deletes_per_s": lua_rate.round(),
        "ceiling": { "what": "raw ZREM + HDEL pipelined, same batching", "deletes_per_s": raw_rate.round() },
        "ratio": common::round2(common::ratio(lua_rate, raw_rate)),
    }))
}

//! A bounded soak: steady mixed traffic (puts, replaces, deletes, random delays of
//! 0–5 s, many topics) through RabbitMQ to a real `redisched run` child process, while
//! the harness records every command it sent (with its confirm time) and every delivery.
//! At the end it proves the promise — every live job delivered at least once, nothing
//! early, nothing delivered after a delete or replace that was confirmed well before
//! its due time, the store's invariants hold (`Store::check`) — and that the memory of
//! Redis and of the bridge stayed flat. Prints the figures.
//!
//! `SOAK_SECS` sets the traffic duration (default 75 s); `SOAK_RATE` the commands per
//! second (default 150).

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::bridge::{header_i64, message_id, now_ms, props, test_config, Broker, ChildBridge};
use common::faults::{bounded, FAULT_TEST_LIMIT};
use lapin::options::BasicPublishOptions;
use lapin::types::AMQPValue;
use rand::Rng;
use redisched::job::Topic;
use redisched_testkit::percentile;

const SECOND: Duration = Duration::from_secs(1);
/// A delete or replace confirmed by the broker this long before the old job's earliest
/// possible due time must win; closer to it, the command races a dispatch in flight
/// (ingest has not applied it yet) and may lose.
const RACE_MARGIN_MS: i64 = 500;
const TOPICS: usize = 40;
const MAX_DELAY_MS: i64 = 5_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Put,
    Replace,
    Delete,
}

#[derive(Debug, Clone)]
struct Sent {
    kind: Kind,
    version: u32,
    delay: i64,
    sent: i64,
    confirmed: i64,
}

#[derive(Debug)]
struct Seen {
    arrived: i64,
    topic: String,
    id: String,
    body: String,
    due_at: i64,
}

fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn redis_used_memory(conn: &mut redis::Connection) -> Option<u64> {
    let info: String = redis::cmd("INFO").arg("memory").query(conn).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn soak_mixed_traffic_keeps_the_promise_with_flat_memory() {
    bounded(FAULT_TEST_LIMIT, async {
        let secs = env_u64("SOAK_SECS", 75);
        let rate = env_u64("SOAK_RATE", 150).max(1);
        let config = test_config("soak");
        let broker = Broker::new(&config).await;
        let mut ready = broker.consume_ready("#").await;
        let mut bridge = ChildBridge::start(&config);
        let pid = bridge.child.id();
        let store = common::test_store_named(&config.redis.prefix).await;

        // Deliveries are drained continuously into `seen`.
        let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<Seen>();
        let collector = tokio::spawn(async move {
            while let Some((arrived, d)) = ready.next(Duration::from_secs(3600)).await {
                let seen = Seen {
                    arrived,
                    topic: d.routing_key.to_string(),
                    id: message_id(&d),
                    body: String::from_utf8_lossy(&d.data).into_owned(),
                    due_at: header_i64(&d, "x-redisched-due-at").unwrap_or(i64::MAX),
                };
                if seen_tx.send(seen).is_err() {
                    break;
                }
            }
        });

        // Memory samples every 3 s, from a plain thread (the Redis client is sync).
        let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let sampler = {
            let sampling = sampling.clone();
            std::thread::spawn(move || {
                let mut conn = common::raw_redis();
                let started = Instant::now();
                let mut samples = Vec::new();
                while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                    samples.push((
                        started.elapsed().as_secs_f64(),
                        rss_kb(pid).unwrap_or(0),
                        redis_used_memory(&mut conn).unwrap_or(0),
                    ));
                    std::thread::sleep(Duration::from_secs(3));
                }
                samples
            })
        };

        // Traffic: every tick, a batch of commands published at once, then their confirms.
        let mut log: HashMap<(String, String), Vec<Sent>> = HashMap::new();
        let mut live: Vec<(String, String, u32)> = Vec::new();
        let mut rng = rand::rng();
        let tick = Duration::from_millis(100);
        let per_tick = ((rate as f64) * tick.as_secs_f64()).ceil() as usize;
        let started = Instant::now();
        let (mut n_put, mut n_replace, mut n_delete, mut next_id) = (0u64, 0u64, 0u64, 0u64);
        let mut next_tick = Instant::now();
        while started.elapsed() < Duration::from_secs(secs) {
            let mut batch = Vec::with_capacity(per_tick);
            for _ in 0..per_tick {
                let roll: f64 = rng.random();
                let delay = rng.random_range(0..=MAX_DELAY_MS);
                let (topic, id, kind, version) = if roll < 0.6 || live.is_empty() {
                    next_id += 1;
                    let topic = format!("soak.{}", next_id as usize % TOPICS);
                    (topic, format!("job-{next_id}"), Kind::Put, 1)
                } else {
                    let pick = rng.random_range(0..live.len());
                    let (topic, id, version) = live.swap_remove(pick);
                    if roll < 0.8 {
                        (topic, id, Kind::Replace, version + 1)
                    } else {
                        (topic, id, Kind::Delete, version)
                    }
                };
                if kind != Kind::Delete {
                    live.push((topic.clone(), id.clone(), version));
                }
                // Recent ids are picked again; old ones have been delivered long ago.
                if live.len() > 400 {
                    live.drain(..100);
                }
                batch.push((topic, id, kind, version, delay));
            }
            let mut pending = Vec::with_capacity(batch.len());
            for (topic, id, kind, version, delay) in batch {
                let headers: Vec<(&str, AMQPValue)> = match kind {
                    Kind::Put => vec![("x-delay", AMQPValue::LongLongInt(delay))],
                    Kind::Replace => vec![
                        ("x-delay", AMQPValue::LongLongInt(delay)),
                        ("x-redisched-op", common::bridge::text("replace")),
                    ],
                    Kind::Delete => vec![("x-redisched-op", common::bridge::text("delete"))],
                };
                let body = format!("{id}|v{version}");
                let sent = now_ms();
                let confirm = broker
                    .channel
                    .basic_publish(
                        config.amqp.commands_exchange.as_str().into(),
                        topic.as_str().into(),
                        BasicPublishOptions::default(),
                        body.as_bytes(),
                        props(&id, &headers),
                    )
                    .await
                    .expect("publish");
                pending.push((topic, id, kind, version, delay, sent, confirm));
            }
            for (topic, id, kind, version, delay, sent, confirm) in pending {
                assert!(confirm.await.expect("confirm").is_ack(), "command nacked");
                let confirmed = now_ms();
                match kind {
                    Kind::Put => n_put += 1,
                    Kind::Replace => n_replace += 1,
                    Kind::Delete => n_delete += 1,
                }
                log.entry((topic, id)).or_default().push(Sent {
                    kind,
                    version,
                    delay,
                    sent,
                    confirmed,
                });
            }
            next_tick += tick;
            tokio::time::sleep_until(next_tick.into()).await;
        }
        let traffic = started.elapsed();
        let commands = n_put + n_replace + n_delete;

        // Wait for the last due job (+ a margin), then until no delivery came for 3 s.
        let last_due = log
            .values()
            .flatten()
            .map(|s| s.sent + s.delay)
            .max()
            .unwrap_or(0);
        let mut seen = Vec::new();
        let settle_deadline = Instant::now() + 120 * SECOND;
        loop {
            while let Ok(s) = seen_rx.try_recv() {
                seen.push(s);
            }
            let quiet = seen
                .last()
                .is_none_or(|s: &Seen| now_ms() - s.arrived > 3_000);
            if (now_ms() > last_due + 5_000 && quiet) || Instant::now() > settle_deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        sampling.store(false, std::sync::atomic::Ordering::Relaxed);
        let samples = sampler.join().expect("sampler");

        // The store is empty and sound.
        let mut leftover = 0;
        let mut problems = Vec::new();
        for t in 0..TOPICS {
            let topic = Topic::new(format!("soak.{t}")).unwrap();
            let stats = store.stats(&topic).await.expect("stats");
            leftover += stats.records;
            let report = store.check(&topic, false).await.expect("check");
            problems.extend(report.problems);
        }
        bridge.terminate();
        collector.abort();

        // Verdicts.
        let mut by_job: HashMap<(String, String), Vec<&Seen>> = HashMap::new();
        for s in &seen {
            by_job
                .entry((s.topic.clone(), s.id.clone()))
                .or_default()
                .push(s);
        }
        let (mut missing, mut early, mut after_cancel, mut duplicates, mut unknown) =
            (Vec::new(), Vec::new(), Vec::new(), 0usize, 0usize);
        let mut lateness = Vec::with_capacity(seen.len());
        for (job, sends) in &log {
            let deliveries = by_job.get(job).map(Vec::as_slice).unwrap_or(&[]);
            let last = sends.last().expect("at least one command");
            // Every live job: its final version delivered at least once.
            if last.kind != Kind::Delete {
                let body = format!("{}|v{}", job.1, last.version);
                if !deliveries.iter().any(|d| d.body == body) {
                    missing.push(job.clone());
                }
            }
            let mut per_version: HashMap<&str, usize> = HashMap::new();
            for d in deliveries {
                *per_version.entry(d.body.as_str()).or_insert(0) += 1;
                let version: u32 = d
                    .body
                    .rsplit_once("|v")
                    .and_then(|(_, v)| v.parse().ok())
                    .unwrap_or(0);
                let Some(index) = sends
                    .iter()
                    .position(|s| s.kind != Kind::Delete && s.version == version)
                else {
                    unknown += 1;
                    continue;
                };
                let put = &sends[index];
                // Never early: due >= (sent + delay), arrival >= due.
                if d.arrived < put.sent + put.delay || d.arrived < d.due_at {
                    early.push((job.clone(), put.sent + put.delay - d.arrived));
                }
                lateness.push(d.arrived - d.due_at.max(put.sent + put.delay));
                // A later command (replace or delete) that was confirmed well before this
                // version could be due must have won.
                if let Some(next) = sends.get(index + 1) {
                    if next.confirmed < put.sent + put.delay - RACE_MARGIN_MS {
                        after_cancel.push((job.clone(), d.body.clone(), next.kind));
                    }
                }
            }
            duplicates += per_version.values().map(|n| n - 1).sum::<usize>();
        }
        lateness.sort_unstable();
        let warm = samples.len() / 4;
        let after_warmup = &samples[warm.min(samples.len())..];
        let first_third = &after_warmup[..after_warmup.len() / 3];
        let last_third = &after_warmup[after_warmup.len() * 2 / 3..];
        let avg = |s: &[(f64, u64, u64)], f: fn(&(f64, u64, u64)) -> u64| {
            s.iter().map(f).sum::<u64>() as f64 / s.len().max(1) as f64
        };
        let (rss_early, rss_late) = (avg(first_third, |s| s.1), avg(last_third, |s| s.1));
        let (redis_early, redis_late) = (avg(first_third, |s| s.2), avg(last_third, |s| s.2));
        let peak_rss = samples.iter().map(|s| s.1).max().unwrap_or(0);
        let peak_redis = samples.iter().map(|s| s.2).max().unwrap_or(0);

        println!(
        "soak: {secs} s of traffic ({traffic:.1?}), {TOPICS} topics, delays 0-{MAX_DELAY_MS} ms"
    );
        println!(
        "soak: {commands} commands ({n_put} put, {n_replace} replace, {n_delete} delete) = {:.0}/s; {} jobs ids",
        commands as f64 / traffic.as_secs_f64(),
        log.len()
    );
        println!(
        "soak: {} deliveries, {duplicates} duplicates, {} missing, {} early, {} after a confirmed cancel, {unknown} unknown",
        seen.len(),
        missing.len(),
        early.len(),
        after_cancel.len()
    );
        println!(
            "soak: lateness p50 {} ms, p99 {} ms, max {} ms",
            percentile(&lateness, 0.5),
            percentile(&lateness, 0.99),
            lateness.last().copied().unwrap_or(0)
        );
        println!(
        "soak: bridge RSS peak {:.1} MiB (after warm-up: {:.1} -> {:.1} MiB); Redis used_memory peak {:.1} MiB ({:.1} -> {:.1} MiB, whole server)",
        peak_rss as f64 / 1024.0,
        rss_early / 1024.0,
        rss_late / 1024.0,
        peak_redis as f64 / 1048576.0,
        redis_early / 1048576.0,
        redis_late / 1048576.0
    );
        println!(
            "soak: store after the run: {leftover} records left, {} problems",
            problems.len()
        );

        assert!(
            missing.is_empty(),
            "live jobs never delivered: {:?}",
            &missing[..missing.len().min(10)]
        );
        assert!(
            early.is_empty(),
            "delivered early: {:?}",
            &early[..early.len().min(10)]
        );
        assert!(
            after_cancel.is_empty(),
            "delivered after a confirmed delete/replace: {:?}",
            &after_cancel[..after_cancel.len().min(10)]
        );
        assert_eq!(unknown, 0, "deliveries of versions never sent");
        assert!(problems.is_empty(), "store invariants: {problems:?}");
        assert_eq!(leftover, 0, "every job delivered and released");
        // Flat: after warm-up the bridge grows by less than 50% + 16 MiB; Redis (a shared
        // server, other tests run beside) by less than 128 MiB.
        assert!(
            rss_late <= rss_early * 1.5 + 16.0 * 1024.0,
            "bridge RSS grew: {rss_early} -> {rss_late} KiB"
        );
        assert!(
            redis_late <= redis_early + 128.0 * 1048576.0,
            "Redis memory grew: {redis_early} -> {redis_late}"
        );
        broker.cleanup().await;
    });
}

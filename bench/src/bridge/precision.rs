//! Scenario 3 (precision): a steady stream of put commands at R/s with random delays,
//! measured end to end by a consumer on the ready exchange: lateness = arrival time
//! minus `x-redisched-due-at`. Redis, the bridge and the consumer share this machine's
//! clock, so a negative lateness would be a job delivered early.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

use super::common::{self, Bridge, Cleanup, Env, Lateness, Ticker};

pub struct Params {
    pub rates: Vec<u64>,
    pub seconds: f64,
    pub max_delay_ms: u64,
    pub body_bytes: usize,
}

pub async fn run(env: &Env, params: &Params) -> Result<Value> {
    let config = common::bench_config(env, "precision");
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    cleanup.queues.push(format!("{name}.sink"));
    eprintln!(
        "precision: rates {:?}/s for {} s each, delays 0-{} ms (names {name}.*)",
        params.rates, params.seconds, params.max_delay_ms
    );
    let result = measure(env, params, &config, &name).await;
    cleanup.run().await;
    result
}

async fn measure(
    env: &Env,
    params: &Params,
    config: &redisched::config::Config,
    name: &str,
) -> Result<Value> {
    let connection = common::amqp(&env.amqp_url).await?;
    let setup = connection.create_channel().await?;
    redisched::amqp::declare_topology(&setup, &config.amqp).await?;
    let sink_queue = format!("{name}.sink");
    common::durable_queue(
        &setup,
        &sink_queue,
        &config.amqp.ready_exchange,
        FieldTable::default(),
    )
    .await?;
    let mut sink = common::sink(&connection, &sink_queue, true).await?;
    let mut bridge = Bridge::start(env, config)?;
    // Let it connect and declare before the clock starts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    bridge.check_alive()?;
    let publisher = connection.create_channel().await?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let body = common::body(params.body_bytes);
    // Seeded: every run draws the same delays.
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut results = Vec::new();
    for &rate in &params.rates {
        let total = (rate as f64 * params.seconds).round() as u64;
        let label = format!("{rate}/s");
        // Paced publishing: every 5 ms, catch up with rate x elapsed.
        let window = Arc::new(Semaphore::new(5000));
        let (tx, mut rx) = mpsc::unbounded_channel::<(
            lapin::PublisherConfirm,
            tokio::sync::OwnedSemaphorePermit,
        )>();
        let confirmer = tokio::spawn(async move {
            let mut refused = 0u64;
            while let Some((confirm, _permit)) = rx.recv().await {
                if !matches!(confirm.await, Ok(lapin::Confirmation::Ack(None))) {
                    refused += 1;
                }
            }
            refused
        });
        let started = Instant::now();
        let mut sent = 0u64;
        let mut behind_max = 0u64;
        let mut ticker = Ticker::new();
        while sent < total {
            let should = ((started.elapsed().as_secs_f64() * rate as f64) as u64).min(total);
            behind_max = behind_max.max(should.saturating_sub(sent));
            while sent < should {
                let permit = window.clone().acquire_owned().await?;
                let delay = rng.random_range(0..=params.max_delay_ms) as i64;
                let id = format!("r{rate}-{sent:010}");
                let props = common::command_props(
                    &id,
                    &[(
                        redisched::amqp::headers::DELAY,
                        AMQPValue::LongLongInt(delay),
                    )],
                );
                let confirm = publisher
                    .basic_publish(
                        config.amqp.commands_exchange.as_str().into(),
                        "bench".into(),
                        BasicPublishOptions::default(),
                        &body,
                        props,
                    )
                    .await?;
                let _ = tx.send((confirm, permit));
                sent += 1;
            }
            if ticker.due() {
                eprint!("\r  {label}: published {sent}/{total}      ");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(tx);
        let publish_secs = started.elapsed().as_secs_f64();
        if confirmer.await? > 0 {
            bail!("some commands were not confirmed by the broker");
        }
        // Collect every delivery of this rate.
        let mut lateness: Vec<f64> = Vec::with_capacity(total as usize);
        let deadline =
            Instant::now() + Duration::from_millis(params.max_delay_ms) + Duration::from_secs(60);
        while (lateness.len() as u64) < total {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, sink.arrivals.recv()).await {
                Ok(Some(arrival)) => {
                    let Some(due) = arrival.due_at_ms else {
                        bail!("a delivery without x-redisched-due-at");
                    };
                    lateness.push(arrival.at_us as f64 / 1000.0 - due as f64);
                }
                Ok(None) => bail!("the consumer stopped"),
                Err(_) => bail!("only {} of {total} jobs arrived", lateness.len()),
            }
            if ticker.due() {
                bridge.check_alive()?;
                eprint!(
                    "\r  {label}: published {total}, delivered {}/{total}      ",
                    lateness.len()
                );
            }
        }
        let stats = Lateness::of(&mut lateness);
        eprintln!(
            "\r  {label}: {} jobs, lateness p50 {} ms, p99 {} ms, p99.9 {} ms, max {} ms, early {}      ",
            stats.count, stats.p50_ms, stats.p99_ms, stats.p999_ms, stats.max_ms, stats.early
        );
        let cdf = cdf_points(&lateness);
        let floor = timer_floor(
            &publisher,
            &config.amqp.ready_exchange,
            &mut sink,
            rate,
            params,
            &mut rng,
        )
        .await?;
        eprintln!(
            "  {label} floor (bench timer -> publish -> consumer, no Redis, no bridge): p50 {} ms, p99 {} ms, p99.9 {} ms, max {} ms",
            floor.p50_ms, floor.p99_ms, floor.p999_ms, floor.max_ms
        );
        let target = match rate {
            r if r <= 1000 => Some(10.0),
            r if r <= 5000 => Some(50.0),
            _ => None,
        };
        results.push(json!({
            "rate_per_s": rate,
            "achieved_publish_rate_per_s": (total as f64 / publish_secs).round(),
            "publisher_max_behind": behind_max,
            "lateness_ms": stats,
            "floor_lateness_ms": floor,
            "target_p99_ms": target,
            "cdf": cdf,
        }));
    }
    let rss = bridge.rss_kib();
    bridge.stop()?;
    let _ = connection.close(200, "bye".into()).await;
    Ok(json!({
        "seconds_per_rate": params.seconds,
        "max_delay_ms": params.max_delay_ms,
        "body_bytes": params.body_bytes,
        "bridge_rss_kib_after": rss,
        "rates": results,
    }))
}

/// The machine's own floor for the same schedule, in the same run: a timer in this
/// process publishes each message at its due time straight to the ready exchange and
/// the same consumer measures it. What the bridge adds is the difference.
async fn timer_floor(
    publisher: &lapin::Channel,
    exchange: &str,
    sink: &mut common::Sink,
    rate: u64,
    params: &Params,
    rng: &mut StdRng,
) -> Result<Lateness> {
    let total = (rate as f64 * params.seconds).round() as u64;
    // Due offsets from the start in µs: submitted at i/rate s, plus a random delay.
    let mut due: Vec<i64> = (0..total)
        .map(|i| {
            (i as f64 * 1e6 / rate as f64) as i64
                + rng.random_range(0..=params.max_delay_ms) as i64 * 1000
        })
        .collect();
    due.sort_unstable();
    // Start on a whole millisecond so due times in ms are exact.
    let start_us = (common::now_us() / 1000 + 5) * 1000;
    let start = Instant::now() + Duration::from_micros((start_us - common::now_us()).max(0) as u64);
    let body = common::body(params.body_bytes);
    let mut next = 0usize;
    while next < due.len() {
        // Round each due time up to the next ms, as the store keeps ms.
        let due_ms = ceil_ms(start_us + due[next]);
        let wake = start + Duration::from_micros((due_ms * 1000 - start_us).max(0) as u64);
        tokio::time::sleep_until(wake.into()).await;
        let now_ms = common::now_us() / 1000;
        while next < due.len() && ceil_ms(start_us + due[next]) <= now_ms {
            let due_at = ceil_ms(start_us + due[next]);
            let props = common::command_props(
                &format!("floor-{next}"),
                &[(
                    redisched::amqp::headers::DUE_AT,
                    AMQPValue::LongLongInt(due_at),
                )],
            );
            // Its confirm is not awaited: delivery to consumers does not wait for it.
            let confirm = publisher
                .basic_publish(
                    exchange.into(),
                    "floor".into(),
                    BasicPublishOptions::default(),
                    &body,
                    props,
                )
                .await?;
            drop(confirm);
            next += 1;
        }
    }
    let mut lateness = Vec::with_capacity(total as usize);
    while (lateness.len() as u64) < total {
        match tokio::time::timeout(Duration::from_secs(30), sink.arrivals.recv()).await {
            Ok(Some(arrival)) => {
                if let Some(due) = arrival.due_at_ms {
                    lateness.push(arrival.at_us as f64 / 1000.0 - due as f64);
                }
            }
            Ok(None) => bail!("the consumer stopped"),
            Err(_) => bail!("floor: only {} of {total} messages arrived", lateness.len()),
        }
    }
    Ok(Lateness::of(&mut lateness))
}

/// Epoch µs rounded up to whole ms.
fn ceil_ms(us: i64) -> i64 {
    (us + 999).div_euclid(1000)
}

/// About 200 points of the sorted lateness: `[ms, fraction ≤ ms]`.
fn cdf_points(sorted: &[f64]) -> Value {
    if sorted.is_empty() {
        return json!([]);
    }
    let n = sorted.len();
    let mut points = Vec::new();
    let mut fractions: Vec<f64> = (0..=190).map(|i| i as f64 / 200.0).collect();
    fractions.extend([0.96, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0]);
    for f in fractions {
        let i = ((f * n as f64).ceil() as usize).clamp(1, n) - 1;
        points.push([common::round2(sorted[i]), f]);
    }
    json!(points)
}

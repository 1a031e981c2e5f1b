//! Scenario 1 (dispatch throughput) and the bridge half of scenario 4 (its RSS).
//!
//! N jobs already due in Redis; a `redisched run` child publishes, gets confirms and
//! releases them; timed from the bridge's start until the store is empty and a consumer
//! on the ready exchange got all N. Ceiling, same run: a plain lapin publisher with
//! confirms, same message (size, persistence, headers, `mandatory`), same window, to a
//! durable queue drained by the same consumer.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use redisched::job::Due;
use serde_json::{json, Value};

use super::common::{self, Bridge, Cleanup, Env, Series, Sink, Ticker};

pub struct Params {
    pub jobs: u64,
    pub body_bytes: usize,
    /// Confirm window of the bridge (`dispatch.window`) and of the ceiling publisher.
    pub window: usize,
    /// Bridge processes sharing the work (several bridges scale out dispatch).
    pub bridges: usize,
}

pub async fn run(env: &Env, params: &Params) -> Result<Value> {
    let mut config = common::bench_config(env, "dispatch");
    config.dispatch.window = params.window;
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    cleanup.exchanges.push(format!("{name}.ceiling"));
    cleanup.queues.push(format!("{name}.ceiling.sink"));
    cleanup.queues.push(format!("{name}.sink"));
    eprintln!(
        "dispatch: {} jobs of {} bytes (names {name}.*)",
        params.jobs, params.body_bytes
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
    let n = params.jobs;
    let window = config.dispatch.window;
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
    let ceiling_exchange = format!("{name}.ceiling");
    let ceiling_queue = format!("{name}.ceiling.sink");
    common::declare_exchange(&setup, &ceiling_exchange).await?;
    common::durable_queue(
        &setup,
        &ceiling_queue,
        &ceiling_exchange,
        FieldTable::default(),
    )
    .await?;

    // Ceiling: what the broker takes from a confirmed publisher like the bridge,
    // measured before and after the bridge (the machine is shared: both count).
    let body = common::body(params.body_bytes);
    let (before, ceiling_series) = ceiling(
        &connection,
        &ceiling_exchange,
        &ceiling_queue,
        n,
        window,
        &body,
    )
    .await?;

    // The bridge.
    let store = common::store(config).await?;
    let topic = common::topic("bench")?;
    common::load_jobs(
        &store,
        &topic,
        "job",
        n,
        &body,
        Due::NOW,
        "load due jobs into Redis",
    )
    .await?;
    let sink = common::sink(&connection, &sink_queue, false).await?;
    let mark = common::CpuMark::now();
    let mut bridge = Bridge::start(env, config)?;
    let others = (1..params.bridges)
        .map(|_| Bridge::start(env, config))
        .collect::<Result<Vec<_>>>()?;
    let started = bridge.started;
    let (consumed, series, first, rss_peak) = watch_sink(
        &sink,
        n,
        started,
        Duration::from_secs(900),
        Some(&mut bridge),
    )
    .await?;
    // The store must be empty too: every job released after its confirm.
    let store_ref = &store;
    let topic_ref = &topic;
    common::wait_until(
        "the store to empty",
        Duration::from_secs(60),
        || async move {
            let stats = store_ref.stats(topic_ref).await?;
            Ok(stats.records == 0)
        },
    )
    .await?;
    let bridge_time = started.elapsed().max(consumed);
    let rss_idle_at = Instant::now() + Duration::from_millis(500);
    let bridge_cpu = mark.per_item(n, bridge.cpu_seconds());
    let bridge_rate = common::per_sec(n, bridge_time);
    let steady = first.map(|f| common::per_sec(n, bridge_time.saturating_sub(f)));
    tokio::time::sleep_until(rss_idle_at.into()).await;
    let rss_idle = bridge.rss_kib();
    let cpu = bridge.cpu_seconds();
    bridge.stop()?;
    for other in others {
        other.stop()?;
    }
    sink.stop().await;
    let (after, _) = ceiling(
        &connection,
        &ceiling_exchange,
        &ceiling_queue,
        n,
        window,
        &body,
    )
    .await?;
    let ceiling_rate = (before.rate + after.rate) / 2.0;
    let _ = connection.close(200, "bye".into()).await;
    let ratio = common::ratio(bridge_rate, ceiling_rate);
    eprintln!(
        "  bridge: {bridge_rate:.0} jobs/s ({:.0}% of ceiling), RSS peak {} KiB",
        ratio * 100.0,
        rss_peak.unwrap_or(0)
    );
    Ok(json!({
        "jobs": n,
        "body_bytes": params.body_bytes,
        "window": window,
        "bridges": params.bridges,
        "bridge": {
            "seconds": common::round2(bridge_time.as_secs_f64()),
            "jobs_per_s": bridge_rate.round(),
            "first_delivery_after_s": first.map(|f| common::round2(f.as_secs_f64())),
            "jobs_per_s_after_first_delivery": steady.map(f64::round),
            "cpu_seconds": cpu.map(common::round2),
            "cpu_per_job": bridge_cpu,
            "series": series.to_json(),
        },
        "ceiling": {
            "what": "lapin publisher, confirms, persistent, mandatory, same size and headers, same window, durable queue drained by the same consumer; mean of a run before and one after the bridge",
            "msgs_per_s": ceiling_rate.round(),
            "before_msgs_per_s": before.rate.round(),
            "after_msgs_per_s": after.rate.round(),
            "publish_confirm_only_msgs_per_s": [before.publish_only_rate.round(), after.publish_only_rate.round()],
            "cpu_per_msg": [before.cpu, after.cpu],
            "series": ceiling_series.to_json(),
        },
        "ratio": common::round2(ratio),
        "target_ratio": 0.8,
        "bridge_rss_kib": { "peak_while_dispatching": rss_peak, "idle_after": rss_idle },
    }))
}

struct Ceiling {
    rate: f64,
    publish_only_rate: f64,
    cpu: Value,
}

async fn ceiling(
    connection: &lapin::Connection,
    exchange: &str,
    queue: &str,
    n: u64,
    window: usize,
    body: &[u8],
) -> Result<(Ceiling, Series)> {
    let sink = common::sink(connection, queue, false).await?;
    let publisher = connection.create_channel().await?;
    let mark = common::CpuMark::now();
    let started = Instant::now();
    let publish = common::publish_confirmed(
        &publisher,
        exchange,
        n,
        window,
        "ceiling: confirmed publish",
        |i| ("bench".to_string(), ready_like_props(i), body.to_vec()),
    );
    let watch = watch_sink(&sink, n, started, Duration::from_secs(600), None);
    let (published, watched) = tokio::join!(publish, watch);
    let published = published?;
    let (consumed, series, _, _) = watched?;
    let cpu = mark.per_item(n, None);
    let _ = publisher.close(200, "done".into()).await;
    sink.stop().await;
    let rate = common::per_sec(n, published.max(consumed));
    let publish_only_rate = common::per_sec(n, published);
    eprintln!("  ceiling: {rate:.0} msg/s published+confirmed+consumed ({publish_only_rate:.0}/s confirmed)");
    Ok((
        Ceiling {
            rate,
            publish_only_rate,
            cpu,
        },
        series,
    ))
}

/// The properties the bridge puts on a job it delivers (no stored properties).
fn ready_like_props(i: u64) -> BasicProperties {
    let id = common::job_id("job", i);
    common::command_props(
        &id,
        &[
            (redisched::amqp::headers::TOPIC, common::text("bench")),
            (
                redisched::amqp::headers::DUE_AT,
                AMQPValue::LongLongInt(1_700_000_000_000 + i as i64),
            ),
            (redisched::amqp::headers::ATTEMPT, AMQPValue::LongLongInt(1)),
        ],
    )
}

/// Waits until `sink` counted `n`; returns the time it took, the rate every 250 ms, the
/// time of the first delivery and (with a bridge) its peak RSS in KiB.
async fn watch_sink(
    sink: &Sink,
    n: u64,
    started: Instant,
    timeout: Duration,
    mut bridge: Option<&mut Bridge>,
) -> Result<(Duration, Series, Option<Duration>, Option<u64>)> {
    let mut series = Series::default();
    series.sample(0.0, 0);
    let mut first = None;
    let mut rss_peak: Option<u64> = None;
    let mut last_sample = Instant::now();
    let mut ticker = Ticker::new();
    loop {
        let count = sink.count.load(Ordering::Relaxed);
        if first.is_none() && count > 0 {
            first = Some(started.elapsed());
        }
        if last_sample.elapsed() >= Duration::from_millis(250) || count >= n {
            last_sample = Instant::now();
            series.sample(started.elapsed().as_secs_f64(), count);
            if let Some(bridge) = bridge.as_deref_mut() {
                bridge.check_alive()?;
                if let Some(rss) = bridge.rss_kib() {
                    rss_peak = Some(rss_peak.unwrap_or(0).max(rss));
                }
            }
        }
        if ticker.due() {
            common::progress("consumed", count, n, started);
        }
        if count >= n {
            common::progress_done("consumed", count, started);
            return Ok((started.elapsed(), series, first, rss_peak));
        }
        if started.elapsed() > timeout {
            bail!("only {count} of {n} messages arrived within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

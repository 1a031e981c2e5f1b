//! The webhook scenario: a `[[targets]]` entry POSTing due jobs to a local receiver (a
//! real HTTP server in this process, on its own runtime and a free port), three figures,
//! each beside its same-run ceiling or floor, `--runs` rounds (median (min–max)):
//!
//! 1. **Throughput.** N jobs already due; a fresh `redisched run` POSTs them (target
//!    `max_in_flight` = M, raw 200-byte bodies); timed from the bridge's start until the
//!    receiver got N and the store is empty. Ceiling: a plain reqwest client (the
//!    bridge's library, built the same way) POSTing N requests of the same body and
//!    headers, M at once, to the same receiver; before and after the bridge, averaged.
//!    Beside them, the bookkeeping floor (`webhook_floor.rs`): the same client's
//!    requests plus only the bare Redis commands a Redis-backed dispatcher needs per
//!    job, the most any such dispatcher could reach on this machine.
//! 2. **Lateness at a steady rate**, vs the producer's clock (publish instant + `x-delay`,
//!    carried in the bench's own headers, forwarded by the target as
//!    `x-redisched-header-*`). Put commands at R/s with delays 0..=D ms for D + W
//!    seconds; only jobs due in `[start + D, start + D + W]` count, so commands come in
//!    and jobs go out at the full rate together (the first D seconds are the warm-up).
//!    Floor, same run and schedule: one AMQP hop and one HTTP request, nothing else: a
//!    producer publishes each message at its due instant to a durable queue, a relay
//!    consumes it (prefetch M, ack after the 2xx) and POSTs it at once with the same
//!    client settings and concurrency M.
//! 3. **Memory.** K due jobs to a target that holds every request (`max_in_flight` = K,
//!    `timeout_ms` above the hold, below `dispatch.ttr_ms`): the bridge's RSS idle, when
//!    all K requests are open at the receiver, and its peak; the difference per request.
//!
//! Targets are file-only config: the child gets them in a TOML file beside its
//! `REDISCHED_*` variables (deleted at the end, with the keys, exchanges and queues).

use std::future::IntoFuture as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use futures_util::{stream, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use redisched::config::Config;
use redisched::job::headers;
use redisched::job::Due;
use redisched::targets::TargetConfig;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::common::{self, Arrival, Bridge, Cleanup, CommandRoute, Env, Lateness, Spread, Ticker};
use super::plain_http::{like_the_bridge, plain_client};
use super::webhook_floor;

pub(super) struct Params {
    /// Due jobs of the throughput figure.
    pub jobs: u64,
    /// The target's `max_in_flight`, and the ceiling's and the floor's concurrency.
    pub max_in_flight: usize,
    pub body_bytes: usize,
    pub runs: usize,
    /// Commands per second of the lateness figure.
    pub rate: u64,
    /// Seconds of steady state measured (after a warm-up of `max_delay_ms`).
    pub seconds: f64,
    pub max_delay_ms: u64,
    /// Requests held open by the slow receiver of the memory figure.
    pub held: u64,
    pub hold_ms: u64,
}

/// The forwarded name of the bench's producer-due header (`forward_headers = true`).
fn forwarded(name: &str) -> String {
    format!("{}{name}", redisched::dispatch::FORWARDED_PREFIX)
}

pub(super) async fn run(env: &Env, params: &Params) -> Result<Value> {
    let config = common::bench_config(env, "webhook");
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    cleanup.queues.push(format!("{name}.relay"));
    let file = std::env::temp_dir().join(format!("{name}.targets.toml"));
    eprintln!(
        "webhook: {} due jobs, max_in_flight {}; lateness at {}/s for {} s after a {} ms warm-up; {} requests held {} ms; {} runs (names {name}.*)",
        params.jobs,
        params.max_in_flight,
        params.rate,
        params.seconds,
        params.max_delay_ms,
        params.held,
        params.hold_ms,
        params.runs
    );
    let receiver = Receiver::start()?;
    let result = measure(env, params, &config, &name, &receiver, &file).await;
    receiver.stop();
    let _ = std::fs::remove_file(&file);
    cleanup.run().await;
    result
}

async fn measure(
    env: &Env,
    params: &Params,
    config: &Config,
    name: &str,
    receiver: &Receiver,
    file: &Path,
) -> Result<Value> {
    let connection = common::amqp(&env.amqp_url).await?;
    let setup = connection.create_channel().await?;
    redisched::amqp::declare_topology(&setup, &config.amqp).await?;
    let relay_queue = format!("{name}.relay");
    setup
        .queue_declare(
            relay_queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .context("declare the relay queue")?;
    let store = common::store(config).await?;
    let body = common::body(params.body_bytes);
    let client = plain_client(params.max_in_flight, 10_000)?;
    let load_before = common::load_average();
    // A few requests first, so the receiver's and the client's first connections are
    // not in the first figure.
    post_many(
        &client,
        &receiver.url("/warm"),
        1_000,
        params.max_in_flight,
        &body,
    )
    .await?;

    let mut throughput = Vec::new();
    let mut lateness = Vec::new();
    let mut memory = Vec::new();
    for run in 0..params.runs {
        eprintln!("  round {}/{}", run + 1, params.runs);
        throughput.push(
            throughput_round(
                env, params, config, receiver, &store, &client, &body, file, run,
            )
            .await?,
        );
        lateness.push(
            lateness_round(
                env,
                params,
                config,
                receiver,
                &connection,
                &relay_queue,
                &client,
                &body,
                file,
                run,
            )
            .await?,
        );
        memory.push(memory_round(env, params, config, receiver, &store, &body, file, run).await?);
    }
    let load_after = common::load_average();
    let _ = connection.close(200, "bye".into()).await;
    let spread = |rounds: &[Value], path: &[&str], decimals: i32| -> Value {
        let values: Vec<f64> = rounds
            .iter()
            .filter_map(|r| path.iter().fold(r, |v, k| &v[*k]).as_f64())
            .collect();
        Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals))
    };
    let t = &throughput;
    let l = &lateness;
    let m = &memory;
    let figure = |rounds: &[Value], side: &str| {
        json!({
            "p50_ms": spread(rounds, &[side, "p50_ms"], 2),
            "p99_ms": spread(rounds, &[side, "p99_ms"], 2),
            "max_ms": spread(rounds, &[side, "max_ms"], 2),
            "early": spread(rounds, &[side, "early"], 0),
            "count": spread(rounds, &[side, "count"], 0),
        })
    };
    Ok(json!({
        "jobs": params.jobs,
        "max_in_flight": params.max_in_flight,
        "body_bytes": params.body_bytes,
        "runs": params.runs,
        "load_average": { "before": load_before, "after": load_after },
        "throughput": {
            "bridge_jobs_per_s": spread(t, &["bridge_jobs_per_s"], 0),
            "bridge_jobs_per_s_after_first_delivery": spread(t, &["bridge_jobs_per_s_after_first_delivery"], 0),
            "evalsha_per_job": spread(t, &["evalsha_per_job"], 3),
            "bridge_cpu_us_per_job": spread(t, &["cpu_per_job", "bridge_us"], 1),
            "redis_cpu_us_per_job": spread(t, &["cpu_per_job", "redis_us"], 1),
            "plain_client_per_s": spread(t, &["plain_client_per_s"], 0),
            "ratio": spread(t, &["ratio"], 3),
            "ratio_after_first_delivery": spread(t, &["ratio_after_first_delivery"], 3),
            "target_ratio": 0.8,
            "bookkeeping_floor_per_s": spread(t, &["bookkeeping_floor_per_s"], 0),
            "bookkeeping_floor_ratio": spread(t, &["bookkeeping_floor_ratio"], 3),
            "bookkeeping_floor": "the plain client's requests plus only the Redis commands a Redis-backed dispatcher needs per job (take: ZRANGEBYSCORE, ZREM, ZADD, HMGET; settle: ZREM, HDEL, LPUSH + LTRIM of one history entry), in calls of up to 64, no per-job Lua; between the bridge and the second plain run, per round (webhook_floor.rs)",
            "ceiling": "plain reqwest client built like the bridge's (no redirects, pooled keep-alive), same body and headers, max_in_flight requests at once, same receiver; mean of a run before and one after the bridge, per round",
            "rounds": t,
        },
        "lateness": {
            "rate_per_s": params.rate,
            "window_s": params.seconds,
            "warm_up_ms": params.max_delay_ms,
            "bridge": figure(l, "bridge"),
            "floor": figure(l, "floor"),
            "p99_vs_floor": spread(l, &["p99_vs_floor"], 2),
            "target": "bridge p99 <= 2 x floor p99, early = 0",
            "figures": {
                "bridge": "arrival at the receiver - (producer's publish instant + x-delay), jobs due within the window",
                "floor": "the same schedule, one AMQP hop + one HTTP request: each message published at its due instant to a durable queue, a relay (prefetch max_in_flight, ack after the 2xx) POSTs it at once; arrival - due instant",
            },
            "rounds": l,
        },
        "memory": {
            "in_flight": params.held,
            "hold_ms": params.hold_ms,
            "idle_kib": spread(m, &["idle_kib"], 0),
            "all_in_flight_kib": spread(m, &["all_in_flight_kib"], 0),
            "peak_kib": spread(m, &["peak_kib"], 0),
            "bytes_per_request_in_flight": spread(m, &["bytes_per_request_in_flight"], 0),
            "open_at_receiver_max": spread(m, &["open_at_receiver_max"], 0),
            "rounds": m,
        },
    }))
}

/// A target serving `topic` (a pattern) at the receiver, with the bench's own settings.
pub(crate) fn target(name: &str, topic: &str, url: String, max_in_flight: usize) -> TargetConfig {
    TargetConfig {
        name: name.into(),
        topics: vec![topic.into()],
        url,
        max_in_flight,
        ..TargetConfig::default()
    }
}

/// Validates `config` (with its targets) and starts a bridge with its targets in `file`.
fn start_bridge(env: &Env, config: &Config, file: &Path) -> Result<Bridge> {
    write_targets(config, file)?;
    Bridge::start_with_file(env, config, file)
}

/// Validates `config` and writes its targets to `file` as TOML (targets have no env
/// form: the child reads them with `--config file`).
pub(crate) fn write_targets(config: &Config, file: &Path) -> Result<()> {
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("bench config: {e}"))?;
    // Each target's keys that differ from a default target: an older `redisched`
    // (compare's baseline), which knows fewer keys, reads the file as well.
    let default = toml::Value::try_from(TargetConfig::default()).context("a default target")?;
    let mut targets = Vec::new();
    for target in &config.targets {
        let toml::Value::Table(mut keys) =
            toml::Value::try_from(target).context("write the targets as TOML")?
        else {
            bail!("a target is not a TOML table");
        };
        keys.retain(|key, value| default.get(key) != Some(value));
        targets.push(toml::Value::Table(keys));
    }
    let mut root = toml::map::Map::new();
    root.insert("targets".into(), toml::Value::Array(targets));
    let text = toml::to_string(&root).context("write the targets as TOML")?;
    std::fs::write(file, text).with_context(|| format!("write {}", file.display()))
}

/// POSTs `n` requests, `concurrency` at once, and reads each answer to its end.
async fn post_many(
    client: &reqwest::Client,
    url: &str,
    n: u64,
    concurrency: usize,
    body: &[u8],
) -> Result<Duration> {
    let started = Instant::now();
    let mut results = stream::iter((0..n).map(|i| async move {
        let response = client
            .post(url)
            .headers(like_the_bridge(i, &[]))
            .body(body.to_vec())
            .send()
            .await
            .context("plain client POST")?;
        let status = response.status();
        let _ = response.bytes().await;
        if !status.is_success() {
            bail!("the receiver answered {status}");
        }
        Ok(())
    }))
    .buffer_unordered(concurrency.max(1));
    while let Some(result) = results.next().await {
        result?;
    }
    Ok(started.elapsed())
}

#[allow(clippy::too_many_arguments)]
async fn throughput_round(
    env: &Env,
    params: &Params,
    base: &Config,
    receiver: &Receiver,
    store: &redisched::store::Store,
    client: &reqwest::Client,
    body: &[u8],
    file: &Path,
    run: usize,
) -> Result<Value> {
    let n = params.jobs;
    let url = receiver.url("/hook");
    let before = post_many(client, &url, n, params.max_in_flight, body).await?;
    let before_rate = common::per_sec(n, before);
    eprintln!("  plain client before: {before_rate:.0} requests/s");

    let topic = common::topic(&format!("hook.{run}"))?;
    let mut config = base.clone();
    config.targets = vec![target(
        "bench",
        topic.as_str(),
        url.clone(),
        params.max_in_flight,
    )];
    common::load_jobs(store, &topic, "job", n, body, Due::NOW, "load due jobs").await?;
    let counted = receiver.count();
    let mark = common::CpuMark::now();
    // How many script calls each job cost (the Redis figure is shared with other users).
    let redis = redis::Client::open(config.redis.url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let scripts_before = crate::private_redis::ServerMark::now(&redis, None).await?;
    let mut bridge = start_bridge(env, &config, file)?;
    let started = bridge.started;
    let mut first: Option<Duration> = None;
    let mut rss_peak = None;
    let mut ticker = Ticker::new();
    let deadline = Instant::now() + Duration::from_secs(900);
    for polls in 0u64.. {
        let got = receiver.count() - counted;
        if got > 0 && first.is_none() {
            first = Some(started.elapsed());
        }
        if got >= n {
            break;
        }
        // /proc is read every 100 ms only: the bench shares the cores with the bridge.
        if polls % 50 == 0 {
            rss_peak = rss_peak.max(bridge.rss_kib());
        }
        if ticker.due() {
            bridge.check_alive()?;
            common::progress("bridge POSTs", got, n, started);
        }
        if Instant::now() > deadline {
            bail!("the bridge delivered {got} of {n} webhook jobs in 900 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let of_topic = &topic;
    common::wait_until(
        "the store to empty",
        Duration::from_secs(60),
        || async move { Ok(store.stats(of_topic).await?.records == 0) },
    )
    .await?;
    let elapsed = started.elapsed();
    let cpu = mark.per_item(n, bridge.cpu_seconds());
    let mut scripts = crate::private_redis::ServerTime::default();
    scripts_before.add_since(
        &crate::private_redis::ServerMark::now(&redis, None).await?,
        &mut scripts,
    );
    bridge.stop()?;
    common::progress_done("bridge POSTs", n, started);
    let bridge_rate = common::per_sec(n, elapsed);
    let steady = first.map(|f| common::per_sec(n, elapsed.saturating_sub(f)));
    let extra = (receiver.count() - counted).saturating_sub(n);

    let floor_keys = webhook_floor::Keys::new(&base.redis.prefix);
    let floor = webhook_floor::pass(
        &redis,
        &floor_keys,
        client,
        &url,
        n,
        params.max_in_flight,
        body,
    )
    .await;
    floor_keys.delete(&mut redis.clone()).await?;
    let floor_rate = common::per_sec(n, floor?);

    let after = post_many(client, &url, n, params.max_in_flight, body).await?;
    let after_rate = common::per_sec(n, after);
    let ceiling = (before_rate + after_rate) / 2.0;
    eprintln!(
        "  plain client after: {after_rate:.0} requests/s; bridge {bridge_rate:.0} jobs/s = {:.0}% of {ceiling:.0}; {:.2} EVALSHA per job; bookkeeping floor {floor_rate:.0} jobs/s = {:.0}%",
        common::ratio(bridge_rate, ceiling) * 100.0,
        scripts.evalsha_calls as f64 / n.max(1) as f64,
        common::ratio(floor_rate, ceiling) * 100.0,
    );
    Ok(json!({
        "bridge_jobs_per_s": bridge_rate.round(),
        "bridge_jobs_per_s_after_first_delivery": steady.map(f64::round),
        "first_delivery_after_s": first.map(|f| common::round2(f.as_secs_f64())),
        "seconds": common::round2(elapsed.as_secs_f64()),
        "plain_client_per_s": ceiling.round(),
        "plain_client_before_per_s": before_rate.round(),
        "plain_client_after_per_s": after_rate.round(),
        "ratio": common::ratio(bridge_rate, ceiling),
        "ratio_after_first_delivery": steady.map(|s| common::ratio(s, ceiling)),
        "bookkeeping_floor_per_s": floor_rate.round(),
        "bookkeeping_floor_ratio": common::ratio(floor_rate, ceiling),
        "duplicates_at_receiver": extra,
        "bridge_rss_peak_kib": rss_peak,
        "cpu_per_job": cpu,
        "evalsha_per_job": scripts.evalsha_calls as f64 / n.max(1) as f64,
        "evalsha_us_per_call": scripts.evalsha_us_per_call(),
        "load_average": common::load_average(),
    }))
}

#[allow(clippy::too_many_arguments)]
async fn lateness_round(
    env: &Env,
    params: &Params,
    base: &Config,
    receiver: &Receiver,
    connection: &Connection,
    relay_queue: &str,
    client: &reqwest::Client,
    body: &[u8],
    file: &Path,
    run: usize,
) -> Result<Value> {
    let rate = params.rate.max(1);
    let total =
        (rate as f64 * (params.seconds + params.max_delay_ms as f64 / 1000.0)).round() as u64;
    let mut rng = StdRng::seed_from_u64(0x5eed + run as u64);
    let delays: Vec<i64> = (0..total)
        .map(|_| rng.random_range(0..=params.max_delay_ms) as i64)
        .collect();
    let window = |start_us: i64| {
        let from = start_us + params.max_delay_ms as i64 * 1000;
        (from, from + (params.seconds * 1e6) as i64)
    };
    let producer = connection.create_channel().await?;
    producer
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    // The bridge: put commands at `rate`, each forwarded to the receiver.
    let topic = format!("late.{run}");
    let mut config = base.clone();
    let mut hook = target("late", &topic, receiver.url("/late"), params.max_in_flight);
    hook.forward_headers = true;
    config.targets = vec![hook];
    let mut bridge = start_bridge(env, &config, file)?;
    // Let it connect and declare before the clock starts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    bridge.check_alive()?;
    let mut arrived = receiver.record();
    let route = CommandRoute {
        exchange: config.amqp.commands_exchange.clone(),
        routing_key: topic.clone(),
        id_prefix: format!("l{run}"),
        deliver_at: false,
    };
    let never = AtomicBool::new(false);
    let label = format!("{rate}/s through the bridge");
    let start_us = common::now_us();
    let paced = common::publish_paced(
        &producer,
        &route,
        rate,
        delays.iter().copied(),
        body,
        &never,
        &label,
    )
    .await?;
    let wait = Duration::from_secs(60) + Duration::from_millis(params.max_delay_ms);
    let arrivals = collect(&mut arrived, total, wait, Some(&mut bridge), &label).await;
    receiver.stop_recording();
    bridge.stop()?;
    let arrivals = arrivals?;
    let bridge_figure = in_window(&arrivals, window(start_us));
    eprintln!(
        "\r  {label}: {} in the window; vs producer clock p50 {} / p99 {} / max {} ms, early {}        ",
        bridge_figure.count, bridge_figure.p50_ms, bridge_figure.p99_ms, bridge_figure.max_ms, bridge_figure.early
    );

    // The floor: the same schedule, each message published at its due instant, relayed
    // at once.
    let relay = Relay::start(
        connection,
        relay_queue,
        receiver.url("/floor"),
        client.clone(),
        params.max_in_flight,
    )
    .await?;
    let label = format!("{rate}/s floor");
    let mut arrived = receiver.record();
    let outcome = async {
        let start_us = publish_at_due(&producer, relay_queue, rate, &delays, body).await?;
        let arrivals = collect(&mut arrived, total, Duration::from_secs(60), None, &label).await?;
        Ok::<_, anyhow::Error>((start_us, arrivals))
    }
    .await;
    let failed = relay.stop().await;
    receiver.stop_recording();
    let (floor_start, floor_arrivals) = outcome?;
    if failed > 0 {
        bail!("{label}: {failed} of the relay's POSTs failed");
    }
    let floor = in_window(&floor_arrivals, window(floor_start));
    // The floor split: how late its producer published, and the hop + POST after that.
    let (from, to) = window(floor_start);
    let due_in_window = |a: &&Arrival| a.producer_due_us.is_some_and(|d| d >= from && d <= to);
    let mut published_late: Vec<f64> = floor_arrivals
        .iter()
        .filter(due_in_window)
        .filter_map(|a| Some((a.published_us? - a.producer_due_us?) as f64 / 1000.0))
        .collect();
    let mut hop: Vec<f64> = floor_arrivals
        .iter()
        .filter(due_in_window)
        .filter_map(|a| Some((a.at_us - a.published_us?) as f64 / 1000.0))
        .collect();
    let published_late = Lateness::of(&mut published_late);
    let hop = Lateness::of(&mut hop);
    eprintln!(
        "  floor split: producer publish vs due p50 {} / p99 {} / max {} ms; publish -> receiver p50 {} / p99 {} / max {} ms",
        published_late.p50_ms, published_late.p99_ms, published_late.max_ms, hop.p50_ms, hop.p99_ms, hop.max_ms
    );
    eprintln!(
        "\r  {label} (one AMQP hop + one POST): p50 {} / p99 {} / max {} ms, early {}        ",
        floor.p50_ms, floor.p99_ms, floor.max_ms, floor.early
    );
    let _ = producer.close(200, "done".into()).await;
    Ok(json!({
        "jobs": total,
        "achieved_publish_rate_per_s": paced.achieved_rate.round(),
        "publisher_max_behind": paced.behind_max,
        "bridge": bridge_figure,
        "floor": floor,
        "floor_producer_publish_vs_due_ms": published_late,
        "floor_publish_to_receiver_ms": hop,
        "p99_vs_floor": common::ratio(bridge_figure.p99_ms, floor.p99_ms),
        "load_average": common::load_average(),
    }))
}

/// Lateness vs the producer's due time of the arrivals due within `[from, to]` (µs).
fn in_window(arrivals: &[Arrival], (from, to): (i64, i64)) -> Lateness {
    let mut values: Vec<f64> = arrivals
        .iter()
        .filter(|a| a.producer_due_us.is_some_and(|d| d >= from && d <= to))
        .filter_map(Arrival::vs_producer_ms)
        .collect();
    Lateness::of(&mut values)
}

/// Publishes the schedule's messages (job `i` due at `i / rate` s + `delays[i]` ms) to
/// `queue`, each at its due instant, carrying it as the producer-due header. Returns the
/// schedule's start (epoch µs).
async fn publish_at_due(
    channel: &Channel,
    queue: &str,
    rate: u64,
    delays: &[i64],
    body: &[u8],
) -> Result<i64> {
    let start_us = common::now_us() + 20_000;
    let start = tokio::time::Instant::now() + Duration::from_millis(20);
    let mut due: Vec<i64> = delays
        .iter()
        .enumerate()
        .map(|(i, d)| start_us + (i as u64 * 1_000_000 / rate) as i64 + d * 1000)
        .collect();
    due.sort_unstable();
    let window = Arc::new(Semaphore::new(5_000));
    let refused = Arc::new(AtomicU64::new(0));
    let mut ticker = Ticker::new();
    for (i, due_us) in due.iter().enumerate() {
        tokio::time::sleep_until(start + Duration::from_micros((due_us - start_us) as u64)).await;
        let permit = window.clone().acquire_owned().await?;
        let headers = [
            (
                common::PUBLISHED_US_HEADER,
                AMQPValue::LongLongInt(common::now_us()),
            ),
            (
                common::PRODUCER_DUE_US_HEADER,
                AMQPValue::LongLongInt(*due_us),
            ),
        ];
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body,
                common::command_props(&format!("floor-{i}"), &headers),
            )
            .await
            .context("publish a floor message")?;
        let refused = refused.clone();
        tokio::spawn(async move {
            if !matches!(confirm.await, Ok(lapin::Confirmation::Ack(None))) {
                refused.fetch_add(1, Ordering::Relaxed);
            }
            drop(permit);
        });
        if ticker.due() {
            eprint!("\r  floor: published {i}      ");
        }
    }
    // Every confirm is in once all permits are back.
    let _all = window.acquire_many(5_000).await?;
    let refused = refused.load(Ordering::Relaxed);
    if refused > 0 {
        bail!("{refused} floor messages were not confirmed by the broker");
    }
    Ok(start_us)
}

/// The floor's relay: consumes the queue (prefetch = the target's `max_in_flight`) and
/// POSTs each message at once, acking it after the 2xx.
struct Relay {
    task: tokio::task::JoinHandle<Result<()>>,
    channel: Channel,
    failed: Arc<AtomicU64>,
}

impl Relay {
    async fn start(
        connection: &Connection,
        queue: &str,
        url: String,
        client: reqwest::Client,
        max_in_flight: usize,
    ) -> Result<Self> {
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(
                max_in_flight.min(u16::MAX as usize) as u16,
                BasicQosOptions::default(),
            )
            .await?;
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "relay".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("consume {queue}"))?;
        let failed = Arc::new(AtomicU64::new(0));
        let counted = failed.clone();
        let due_header = forwarded(common::PRODUCER_DUE_US_HEADER);
        let published_header = forwarded(common::PUBLISHED_US_HEADER);
        let task = tokio::spawn(async move {
            let mut n = 0u64;
            while let Some(delivery) = consumer.next().await {
                let delivery = delivery?;
                let due_us =
                    common::int_header(&delivery.properties, common::PRODUCER_DUE_US_HEADER)
                        .context("a floor message without its due time")?;
                let published_us =
                    common::int_header(&delivery.properties, common::PUBLISHED_US_HEADER)
                        .unwrap_or(0);
                let request = client
                    .post(url.as_str())
                    .headers(like_the_bridge(
                        n,
                        &[
                            (due_header.as_str(), due_us.to_string()),
                            (published_header.as_str(), published_us.to_string()),
                        ],
                    ))
                    .body(delivery.data.clone());
                n += 1;
                let failed = counted.clone();
                tokio::spawn(async move {
                    let ok = match request.send().await {
                        Ok(response) => {
                            let status = response.status();
                            let _ = response.bytes().await;
                            status.is_success()
                        }
                        Err(_) => false,
                    };
                    if !ok {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = delivery.acker.ack(BasicAckOptions::default()).await;
                });
            }
            Ok(())
        });
        Ok(Self {
            task,
            channel,
            failed,
        })
    }

    /// Stops relaying (every message has arrived by now); returns the failed POSTs.
    async fn stop(self) -> u64 {
        self.task.abort();
        let _ = self.task.await;
        let _ = self.channel.close(200, "done".into()).await;
        self.failed.load(Ordering::Relaxed)
    }
}

#[allow(clippy::too_many_arguments)]
async fn memory_round(
    env: &Env,
    params: &Params,
    base: &Config,
    receiver: &Receiver,
    store: &redisched::store::Store,
    body: &[u8],
    file: &Path,
    run: usize,
) -> Result<Value> {
    let k = params.held;
    let topic = common::topic(&format!("slow.{run}"))?;
    let mut config = base.clone();
    let mut hook = target("slow", topic.as_str(), receiver.url("/slow"), k as usize);
    // The answer comes after the hold; the reservation outlives the request.
    hook.timeout_ms = params.hold_ms + 30_000;
    config.dispatch.ttr_ms = hook.timeout_ms + 30_000;
    config.targets = vec![hook];
    receiver.hold(Duration::from_millis(params.hold_ms));
    let outcome = async {
        let mut bridge = start_bridge(env, &config, file)?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        bridge.check_alive()?;
        // The most of ten samples: one early read under load saw the process before
        // it had mapped its binary.
        let mut idle = None;
        for _ in 0..10 {
            idle = idle.max(bridge.rss_kib());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let counted = receiver.count();
        common::load_jobs(store, &topic, "slow", k, body, Due::NOW, "load due jobs").await?;
        // All requests open at the receiver (or as many as came before the first answers).
        let started = Instant::now();
        let hold = Duration::from_millis(params.hold_ms);
        let mut open_max = 0;
        let mut at_full = None;
        let mut peak = None;
        let mut ticker = Ticker::new();
        while started.elapsed() < hold {
            let open = receiver.open();
            let rss = bridge.rss_kib();
            peak = peak.max(rss);
            if open > open_max {
                open_max = open;
                at_full = rss;
            }
            if open >= k && started.elapsed() > hold / 2 {
                break;
            }
            if ticker.due() {
                bridge.check_alive()?;
                eprint!("\r  slow target: {open}/{k} requests open, bridge RSS {} KiB     ", rss.unwrap_or(0));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!("\r  slow target: at most {open_max}/{k} requests open, bridge RSS idle {} KiB, with them {} KiB        ", idle.unwrap_or(0), at_full.unwrap_or(0));
        // Then every job answered and released.
        let deadline = Instant::now() + hold + Duration::from_secs(120);
        while receiver.count() - counted < k || store.stats(&topic).await?.records > 0 {
            peak = peak.max(bridge.rss_kib());
            if Instant::now() > deadline {
                bail!("slow target: {} of {k} delivered", receiver.count() - counted);
            }
            bridge.check_alive()?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let after = bridge.rss_kib();
        bridge.stop()?;
        let per_request = match (idle, at_full) {
            (Some(idle), Some(full)) if open_max > 0 => {
                Some((full.saturating_sub(idle) * 1024) as f64 / open_max as f64)
            }
            _ => None,
        };
        Ok::<_, anyhow::Error>(json!({
            "idle_kib": idle,
            "all_in_flight_kib": at_full,
            "peak_kib": peak,
            "after_kib": after,
            "open_at_receiver_max": open_max,
            "bytes_per_request_in_flight": per_request.map(f64::round),
            "load_average": common::load_average(),
        }))
    }
    .await;
    receiver.hold(Duration::ZERO);
    outcome
}

/// Waits for `total` arrivals on `rx` (within `wait`), checking the bridge if given.
async fn collect(
    rx: &mut mpsc::UnboundedReceiver<Arrival>,
    total: u64,
    wait: Duration,
    mut bridge: Option<&mut Bridge>,
    label: &str,
) -> Result<Vec<Arrival>> {
    let mut arrivals = Vec::with_capacity(total as usize);
    let deadline = Instant::now() + wait;
    let mut ticker = Ticker::new();
    while (arrivals.len() as u64) < total {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left.min(Duration::from_secs(1)), rx.recv()).await {
            Ok(Some(arrival)) => arrivals.push(arrival),
            Ok(None) => bail!("the receiver stopped"),
            Err(_) if Instant::now() >= deadline => {
                bail!("{label}: only {} of {total} jobs arrived", arrivals.len())
            }
            Err(_) => {}
        }
        if ticker.due() {
            if let Some(bridge) = bridge.as_deref_mut() {
                bridge.check_alive()?;
            }
            eprint!(
                "\r  {label}: delivered {}/{total}                ",
                arrivals.len()
            );
        }
    }
    Ok(arrivals)
}

/// The webhook consumer every figure posts to: counts requests, keeps their arrival and
/// producer-clock headers while recording, holds each for a while if told. Runs on a
/// runtime of its own so the bench's client does not share its threads' queues.
pub(crate) struct Receiver {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[derive(Default)]
struct Shared {
    count: AtomicU64,
    open: AtomicU64,
    hold_ms: AtomicU64,
    recording: AtomicBool,
    arrivals: Mutex<Option<mpsc::UnboundedSender<Arrival>>>,
    due_header: String,
    published_header: String,
}

impl Receiver {
    pub(crate) fn start() -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("bind the receiver")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            due_header: forwarded(common::PRODUCER_DUE_US_HEADER),
            published_header: forwarded(common::PUBLISHED_US_HEADER),
            ..Shared::default()
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let state = shared.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("receiver")
            .enable_all()
            .build()
            .context("the receiver's runtime")?;
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    eprintln!("webhook receiver: cannot listen");
                    return;
                };
                let app = axum::Router::new().fallback(handle).with_state(state);
                tokio::select! {
                    served = axum::serve(listener, app).into_future() => {
                        if let Err(err) = served {
                            eprintln!("webhook receiver: {err}");
                        }
                    }
                    _ = stopped => {}
                }
            });
            // Dropping the runtime ends the open connections' tasks.
        });
        Ok(Self {
            addr,
            shared,
            stop: Mutex::new(Some(stop)),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub(crate) fn count(&self) -> u64 {
        self.shared.count.load(Ordering::Relaxed)
    }

    /// Requests being held right now.
    fn open(&self) -> u64 {
        self.shared.open.load(Ordering::Relaxed)
    }

    fn hold(&self, hold: Duration) {
        self.shared
            .hold_ms
            .store(hold.as_millis() as u64, Ordering::Relaxed);
    }

    /// Starts keeping arrivals: they come out of the returned channel until
    /// [`Receiver::stop_recording`].
    fn record(&self) -> mpsc::UnboundedReceiver<Arrival> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut slot) = self.shared.arrivals.lock() {
            *slot = Some(tx);
        }
        self.shared.recording.store(true, Ordering::Relaxed);
        rx
    }

    fn stop_recording(&self) {
        self.shared.recording.store(false, Ordering::Relaxed);
        if let Ok(mut slot) = self.shared.arrivals.lock() {
            *slot = None;
        }
    }

    pub(crate) fn stop(&self) {
        if let Some(stop) = self.stop.lock().ok().and_then(|mut s| s.take()) {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = thread.join();
        }
    }
}

async fn handle(State(shared): State<Arc<Shared>>, request: HeaderMap, _body: Bytes) -> StatusCode {
    let at_us = common::now_us();
    shared.count.fetch_add(1, Ordering::Relaxed);
    if shared.recording.load(Ordering::Relaxed) {
        let int = |name: &str| {
            request
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i64>().ok())
        };
        let arrival = Arrival {
            at_us,
            due_at_ms: int(headers::DUE_AT),
            published_us: int(&shared.published_header),
            producer_due_us: int(&shared.due_header),
        };
        if let Some(tx) = shared.arrivals.lock().ok().and_then(|a| a.clone()) {
            let _ = tx.send(arrival);
        }
    }
    let hold = shared.hold_ms.load(Ordering::Relaxed);
    if hold > 0 {
        shared.open.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(hold)).await;
        shared.open.fetch_sub(1, Ordering::Relaxed);
    }
    StatusCode::OK
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival(at_us: i64, producer_due_us: Option<i64>) -> Arrival {
        Arrival {
            at_us,
            due_at_ms: None,
            published_us: None,
            producer_due_us,
        }
    }

    #[test]
    fn only_jobs_due_inside_the_window_count_and_early_ones_are_counted() {
        let arrivals = [
            // Due in the warm-up: left out however late.
            arrival(5_000_000, Some(999_999)),
            arrival(1_002_000, Some(1_000_000)),
            // 1 ms early.
            arrival(1_500_000, Some(1_501_000)),
            arrival(2_004_000, Some(2_000_000)),
            // Due after the window: left out.
            arrival(9_000_000, Some(2_000_001)),
            // Without the forwarded header: left out.
            arrival(1_200_000, None),
        ];
        let l = in_window(&arrivals, (1_000_000, 2_000_000));
        assert_eq!(l.count, 3);
        assert_eq!(l.early, 1);
        assert_eq!(l.max_ms, 4.0);
        assert_eq!(l.p50_ms, 2.0);
    }
}

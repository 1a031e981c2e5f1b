//! Scenario 1 (dispatch throughput) and the bridge half of scenario 4 (its RSS).
//!
//! N jobs already due in Redis; a `redisched run` child publishes, gets confirms and
//! releases them; timed from the bridge's start until the store is empty and a consumer
//! on the ready exchange got all N. Ceiling, same run: a plain lapin publisher with
//! confirms, same message (size, persistence, headers, `mandatory`), same window, to a
//! durable queue drained by the same consumer (before and after the bridge, averaged).
//!
//! Beside it, the **best publisher**: the broker's best confirmed persistent publish
//! rate with any number of publishers, the physical limit of this machine. The same N
//! messages split over 2, 4 and 8 publishers, each on its own connection and channel
//! with its own window (the bridge's), into the same queue and consumer; the
//! one-publisher figure is the ceiling's run before the bridge. The best of them, and
//! how many publishers gave it, is reported with the bridge's ratio to it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use redisched::job::Due;
use serde_json::{json, Value};

use super::common::{
    self, Bridge, Cleanup, Env, History, HistoryChoice, Series, Sink, Spread, Ticker,
};

pub(super) struct Params {
    pub jobs: u64,
    pub body_bytes: usize,
    /// Confirm window of the bridge (`dispatch.window`) and of the ceiling publisher.
    pub window: usize,
    /// Confirm channels of the bridge (`dispatch.channels`).
    pub channels: usize,
    /// Bridge processes sharing the work (several bridges scale out dispatch).
    pub bridges: usize,
    /// Which `history.max_per_topic` settings to measure.
    pub history: HistoryChoice,
    /// Bridge passes per history side.
    pub runs: usize,
}

pub(super) async fn run(env: &Env, params: &Params) -> Result<Value> {
    let mut config = common::bench_config(env, "dispatch");
    config.dispatch.window = params.window;
    config.dispatch.channels = params.channels;
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    CeilingPath::clean_up(&mut cleanup, &name);
    cleanup.queues.push(format!("{name}.sink"));
    eprintln!(
        "dispatch: {} jobs of {} bytes, {} confirm channel(s) (names {name}.*)",
        params.jobs, params.body_bytes, params.channels
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
    // Ceiling: what the broker takes from a confirmed publisher like the bridge,
    // measured before and after the bridge (the machine is shared: both count).
    let body = common::body(params.body_bytes);
    let ceiling = CeilingPath::declare(&setup, name, window, &body).await?;
    let (before, ceiling_series) = ceiling.measure(&connection, n).await?;
    let best = ceiling
        .best_publisher(&env.amqp_url, &connection, n, before.rate)
        .await?;

    // The bridge: `runs` passes per history side, alternating (History::order).
    let store = common::store(config).await?;
    let topic = common::topic("bench")?;
    let history_key = store.keys().all(&topic)[6].clone();
    let redis = redis::Client::open(config.redis.url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    // Warm-up (not counted): the first pass of a run was markedly slower in trials
    // (queue, connections and caches cold), which would favour whichever side came second.
    let warm_up = n.min(20_000);
    eprintln!("  warm-up pass: {warm_up} jobs, not counted");
    bridge_pass(
        env,
        params,
        config,
        &connection,
        &sink_queue,
        &store,
        &topic,
        &body,
        warm_up,
    )
    .await?;
    let load_before = common::load_average();
    let mut passes: Vec<(usize, History, Pass)> = Vec::new();
    for run in 0..params.runs {
        for side in params.history.sides(run) {
            eprintln!(
                "  pass {}/{}: history {} (history.max_per_topic = {})",
                run + 1,
                params.runs,
                side.name(),
                side.max()
            );
            // Each pass starts with no history, so its count can be checked.
            let _: u64 = redis::cmd("DEL")
                .arg(&history_key)
                .query_async(&mut redis.clone())
                .await?;
            let mut side_config = config.clone();
            side_config.history.max_per_topic = side.max();
            let pass = bridge_pass(
                env,
                params,
                &side_config,
                &connection,
                &sink_queue,
                &store,
                &topic,
                &body,
                n,
            )
            .await?;
            let entries = store.stats(&topic).await?.history;
            let expected = n.min(u64::from(side.max()));
            if entries != expected {
                bail!(
                    "history {}: {entries} history entries after {n} dispatches, expected {expected}",
                    side.name()
                );
            }
            eprintln!(
                "  bridge, history {}: {:.0} jobs/s, {entries} history entries",
                side.name(),
                pass.rate
            );
            passes.push((run, side, pass));
        }
    }
    let load_after = common::load_average();
    let (after, _) = ceiling.measure(&connection, n).await?;
    let ceiling_rate = (before.rate + after.rate) / 2.0;
    let _ = connection.close(200, "bye".into()).await;
    // The detailed figures (series, CPU, RSS) are those of the median pass with the
    // default history (else of the side measured).
    let side = if passes.iter().any(|(_, s, _)| *s == History::On) {
        History::On
    } else {
        History::Off
    };
    let mut of_side: Vec<&Pass> = passes
        .iter()
        .filter(|(_, s, _)| *s == side)
        .map(|(_, _, pass)| pass)
        .collect();
    of_side.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let shown = *of_side.get(of_side.len() / 2).context("no bridge pass")?;
    let bridge_rate = shown.rate;
    let ratio = common::ratio(bridge_rate, ceiling_rate);
    let ratio_to_best = common::ratio(bridge_rate, best.rate);
    eprintln!(
        "  bridge: {bridge_rate:.0} jobs/s ({:.0}% of the one-publisher ceiling, {:.0}% of the best publisher: {} publishers, {:.0}/s), RSS peak {} KiB",
        ratio * 100.0,
        ratio_to_best * 100.0,
        best.publishers,
        best.rate,
        shown.rss_peak.unwrap_or(0)
    );
    let history = history_summary(&passes, ceiling_rate, params, load_before, load_after);
    Ok(json!({
        "jobs": n,
        "body_bytes": params.body_bytes,
        "window": window,
        "channels": params.channels,
        "bridges": params.bridges,
        "bridge": {
            "history_max": shown.history_max,
            "seconds": common::round2(shown.seconds),
            "jobs_per_s": bridge_rate.round(),
            "first_delivery_after_s": shown.first.map(|f| common::round2(f.as_secs_f64())),
            "jobs_per_s_after_first_delivery": shown.steady.map(f64::round),
            "cpu_seconds": shown.cpu.map(common::round2),
            "cpu_per_job": shown.cpu_per_job.clone(),
            "series": shown.series.to_json(),
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
        "best_publisher": {
            "what": "the same n messages split over k publishers, each its own connection, channel and window, same queue and consumer; k = 1 is the ceiling's run before the bridge; the best k is kept",
            "msgs_per_s": best.rate.round(),
            "publishers": best.publishers,
            "window_per_publisher": window,
            "trials": best.trials,
        },
        "ratio": common::round2(ratio),
        "ratio_to_best_publisher": common::round2(ratio_to_best),
        "target_ratio": 0.8,
        "bridge_rss_kib": { "peak_while_dispatching": shown.rss_peak, "idle_after": shown.rss_idle },
        "history": history,
    }))
}

/// One bridge pass: `n` due jobs loaded, a fresh `redisched run` (with `config`'s
/// history cap) publishes, confirms and releases them; timed from its start until the
/// consumer got all and the store is empty.
struct Pass {
    history_max: u32,
    rate: f64,
    seconds: f64,
    steady: Option<f64>,
    first: Option<Duration>,
    series: Series,
    rss_peak: Option<u64>,
    rss_idle: Option<u64>,
    cpu: Option<f64>,
    cpu_per_job: Value,
}

#[allow(clippy::too_many_arguments)]
async fn bridge_pass(
    env: &Env,
    params: &Params,
    config: &redisched::config::Config,
    connection: &lapin::Connection,
    sink_queue: &str,
    store: &redisched::store::Store,
    topic: &redisched::job::Topic,
    body: &[u8],
    n: u64,
) -> Result<Pass> {
    common::load_jobs(
        store,
        topic,
        "job",
        n,
        body,
        Due::NOW,
        "load due jobs into Redis",
    )
    .await?;
    let sink = common::sink(connection, sink_queue, false).await?;
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
    common::wait_until(
        "the store to empty",
        Duration::from_secs(60),
        || async move {
            let stats = store.stats(topic).await?;
            Ok(stats.records == 0)
        },
    )
    .await?;
    let bridge_time = started.elapsed().max(consumed);
    let rss_idle_at = Instant::now() + Duration::from_millis(500);
    let cpu_per_job = mark.per_item(n, bridge.cpu_seconds());
    let rate = common::per_sec(n, bridge_time);
    let steady = first.map(|f| common::per_sec(n, bridge_time.saturating_sub(f)));
    tokio::time::sleep_until(rss_idle_at.into()).await;
    let rss_idle = bridge.rss_kib();
    let cpu = bridge.cpu_seconds();
    bridge.stop()?;
    for other in others {
        other.stop()?;
    }
    sink.stop().await;
    Ok(Pass {
        history_max: config.history.max_per_topic,
        rate,
        seconds: bridge_time.as_secs_f64(),
        steady,
        first,
        series,
        rss_peak,
        rss_idle,
        cpu,
        cpu_per_job,
    })
}

/// Medians (min–max) per side and the on/off ratio paired within each round.
fn history_summary(
    passes: &[(usize, History, Pass)],
    ceiling_rate: f64,
    params: &Params,
    load_before: Value,
    load_after: Value,
) -> Value {
    let rates = |side: History| -> Vec<f64> {
        passes
            .iter()
            .filter(|(_, s, _)| *s == side)
            .map(|(_, _, p)| p.rate)
            .collect()
    };
    let steady = |side: History| -> Vec<f64> {
        passes
            .iter()
            .filter(|(_, s, _)| *s == side)
            .filter_map(|(_, _, p)| p.steady)
            .collect()
    };
    let rate_of = |run: usize, side: History, steady: bool| {
        passes
            .iter()
            .find(|(r, s, _)| *r == run && *s == side)
            .and_then(|(_, _, p)| if steady { p.steady } else { Some(p.rate) })
    };
    let paired = |steady: bool| -> Vec<f64> {
        (0..params.runs)
            .filter_map(|run| {
                Some(rate_of(run, History::On, steady)? / rate_of(run, History::Off, steady)?)
            })
            .collect()
    };
    let spread = |values: Vec<f64>, decimals: i32| {
        Spread::of(&values).map_or(Value::Null, |s| s.to_json(decimals))
    };
    let mut sides = json!({});
    for side in [History::On, History::Off] {
        let r = rates(side);
        if r.is_empty() {
            continue;
        }
        let vs_ceiling: Vec<f64> = r.iter().map(|x| common::ratio(*x, ceiling_rate)).collect();
        sides[side.name()] = json!({
            "history_max": side.max(),
            "jobs_per_s": spread(r, 0),
            "jobs_per_s_after_first_delivery": spread(steady(side), 0),
            "vs_ceiling": spread(vs_ceiling, 3),
        });
    }
    json!({
        "choice": format!("{:?}", params.history).to_lowercase(),
        "runs": params.runs,
        "order": "alternating: on first in odd rounds, off first in even ones",
        "sides": sides,
        "ratio_on_off": {
            "jobs_per_s": spread(paired(false), 3),
            "jobs_per_s_after_first_delivery": spread(paired(true), 3),
        },
        "load_average": { "before": load_before, "after": load_after },
        "passes": passes.iter().map(|(run, side, p)| json!({
            "run": run + 1,
            "history": side.name(),
            "jobs_per_s": p.rate.round(),
            "jobs_per_s_after_first_delivery": p.steady.map(f64::round),
            "seconds": common::round2(p.seconds),
        })).collect::<Vec<_>>(),
    })
}

/// The ceiling's own exchange and durable queue (`<name>.ceiling`,
/// `<name>.ceiling.sink`), and the message body and window it publishes with.
pub(super) struct CeilingPath {
    exchange: String,
    queue: String,
    window: usize,
    body: Vec<u8>,
}

impl CeilingPath {
    fn names(name: &str) -> (String, String) {
        (format!("{name}.ceiling"), format!("{name}.ceiling.sink"))
    }

    /// Registers the ceiling's exchange and queue of run `name` for deletion.
    pub(super) fn clean_up(cleanup: &mut Cleanup, name: &str) {
        let (exchange, queue) = Self::names(name);
        cleanup.exchanges.push(exchange);
        cleanup.queues.push(queue);
    }

    pub(super) async fn declare(
        setup: &lapin::Channel,
        name: &str,
        window: usize,
        body: &[u8],
    ) -> Result<Self> {
        let (exchange, queue) = Self::names(name);
        common::declare_exchange(setup, &exchange).await?;
        common::durable_queue(setup, &queue, &exchange, FieldTable::default()).await?;
        Ok(Self {
            exchange,
            queue,
            window,
            body: body.to_vec(),
        })
    }

    /// One plain confirmed publisher: `n` messages like the bridge's, published and
    /// consumed; the rate counts until both are done.
    pub(super) async fn measure(
        &self,
        connection: &lapin::Connection,
        n: u64,
    ) -> Result<(Ceiling, Series)> {
        let sink = common::sink(connection, &self.queue, false).await?;
        let publisher = connection.create_channel().await?;
        let mark = common::CpuMark::now();
        let started = Instant::now();
        let publish = common::publish_confirmed(
            &publisher,
            &self.exchange,
            n,
            self.window,
            "ceiling: confirmed publish",
            |i| ("bench".to_string(), ready_like_props(i), self.body.clone()),
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

    /// The best-publisher sweep (module docs): `n` messages split over k publishers,
    /// each on its own connection, drained by one consumer; `single` is the k = 1 rate.
    async fn best_publisher(
        &self,
        amqp_url: &str,
        connection: &lapin::Connection,
        n: u64,
        single: f64,
    ) -> Result<BestPublisher> {
        let mut best = BestPublisher {
            rate: single,
            publishers: 1,
            trials: vec![json!({ "publishers": 1, "msgs_per_s": single.round() })],
        };
        for k in PUBLISHER_COUNTS {
            let sink = common::sink(connection, &self.queue, false).await?;
            let mut connections = Vec::with_capacity(k);
            for _ in 0..k {
                connections.push(common::amqp(amqp_url).await?);
            }
            let mut channels = Vec::with_capacity(k);
            for c in &connections {
                channels.push(c.create_channel().await?);
            }
            let share = n.div_ceil(k as u64);
            let started = Instant::now();
            let publishers = channels.iter().enumerate().map(|(p, channel)| {
                let first = p as u64 * share;
                let count = share.min(n.saturating_sub(first));
                common::publish_confirmed(
                    channel,
                    &self.exchange,
                    count,
                    self.window,
                    "",
                    move |i| {
                        (
                            "bench".to_string(),
                            ready_like_props(first + i),
                            self.body.clone(),
                        )
                    },
                )
            });
            let publish = futures_util::future::try_join_all(publishers);
            let watch = watch_sink(&sink, n, started, Duration::from_secs(600), None);
            let (published, watched) = tokio::join!(publish, watch);
            let published = published?;
            let (consumed, _, _, _) = watched?;
            let slowest = published.into_iter().max().unwrap_or_default();
            let rate = common::per_sec(n, slowest.max(consumed));
            eprintln!(
                "  best publisher: {k} publishers, {rate:.0} msg/s published+confirmed+consumed"
            );
            for c in connections {
                let _ = c.close(200, "done".into()).await;
            }
            sink.stop().await;
            best.trials
                .push(json!({ "publishers": k, "msgs_per_s": rate.round() }));
            if rate > best.rate {
                best.rate = rate;
                best.publishers = k;
            }
        }
        Ok(best)
    }
}

/// The best confirmed persistent publish rate over several publisher counts.
struct BestPublisher {
    rate: f64,
    publishers: usize,
    trials: Vec<Value>,
}

/// Publisher counts tried beyond the single one (measured by `CeilingPath::measure`).
const PUBLISHER_COUNTS: [usize; 3] = [2, 4, 8];

pub(super) struct Ceiling {
    pub(super) rate: f64,
    pub(super) publish_only_rate: f64,
    pub(super) cpu: Value,
}

/// The properties the bridge puts on a job it delivers (no stored properties).
fn ready_like_props(i: u64) -> BasicProperties {
    let id = common::job_id("job", i);
    common::command_props(
        &id,
        &[
            (redisched::job::headers::TOPIC, common::text("bench")),
            (
                redisched::job::headers::DUE_AT,
                AMQPValue::LongLongInt(1_700_000_000_000 + i as i64),
            ),
            (redisched::job::headers::ATTEMPT, AMQPValue::LongLongInt(1)),
        ],
    )
}

/// Waits until `sink` counted `n`; returns the time it took, the rate every 250 ms, the
/// time of the first delivery and (with a bridge) its peak RSS in KiB.
pub(super) async fn watch_sink(
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

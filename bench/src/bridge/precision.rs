//! Scenario 3 (precision): a steady stream of put commands at R/s with random delays
//! through the bridge's real commands exchange and queue (production defaults: quorum,
//! single active consumer), measured end to end by a consumer on the ready exchange.
//!
//! **Steady state.** Commands are published for `warm_up_ms` (default: the longest delay)
//! plus `seconds`, and only jobs due within the last `seconds` of publishing are counted
//! (every job is still delivered and checked): from the warm-up on, jobs fall due at the
//! full rate while commands still come in at it, the state in which ingest and dispatch
//! share the machine. Before it, dispatch is still ramping up; after publishing stops,
//! ingest is idle.
//!
//! Two lateness figures per job:
//! - **vs `x-redisched-due-at`**: arrival minus the due time the bridge computed when it
//!   applied the command: what dispatch adds;
//! - **vs the producer's clock**: arrival minus (publish instant + `x-delay`), both
//!   carried in the bench's own headers: what a user feels, since `x-delay` counts from
//!   when the bridge applies the command, so the wait in the commands queue and in an
//!   ingest batch shifts the due time too (reported as the apply shift).
//!
//! Beside them, the same run's **two-hop floor** for the same schedule (same rate, same
//! delays, same body), with no Redis and no bridge: publish (confirmed, persistent) → a
//! relay queue with the commands queue's arguments → a relay in this process that holds
//! each message until publish instant + delay (a timer, ms resolution like the store),
//! then publishes it (confirmed, persistent, `mandatory`, the bridge's window) to the
//! ready exchange → the same consumer, measured against the producer's clock. The relay
//! has a connection for each direction, as the bridge has for ingest and dispatch, so its
//! publishes never queue behind its own consumer's traffic (a relay sharing the
//! producer's and consumer's connection fell a second behind at 5,000/s in steady state). Its
//! second hop alone, measured against the relay's own target time, is the **one-hop
//! floor** (timer → publish → consume) that earlier versions measured in a pass of their
//! own; it is now taken from the two-hop pass, which halves the floor's time. Its
//! **first hop** alone (publish → the relay's receipt) is reported too: the broker's
//! share of the bridge's apply shift, which the relay's hold absorbs and `x-delay` does
//! not.
//!
//! With `--deliver-at` the commands name their due time as `x-deliver-at` (publish
//! instant + delay on the producer's clock, rounded up to whole ms) instead of
//! `x-delay`, so the apply shift is only that rounding.
//!
//! Redis, the bridge, the relay and the consumer share this machine's clock, so a
//! negative lateness would be a job delivered early.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use redisched::job::headers;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

use super::common::{
    self, Arrival, Bridge, Cleanup, CommandRoute, CpuMark, Env, Lateness, Paced, Sink, Ticker,
};

pub(super) struct Params {
    pub rates: Vec<u64>,
    pub seconds: f64,
    pub max_delay_ms: u64,
    /// Load before the measured seconds (module docs).
    pub warm_up_ms: u64,
    pub body_bytes: usize,
    /// Commands carry `x-deliver-at` instead of `x-delay` (`--deliver-at`).
    pub deliver_at: bool,
}

pub(super) async fn run(env: &Env, params: &Params) -> Result<Value> {
    let config = common::bench_config(env, "precision");
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    cleanup.queues.push(format!("{name}.sink"));
    cleanup.queues.push(format!("{name}.relay"));
    cleanup.exchanges.push(format!("{name}.relay"));
    eprintln!(
        "precision: rates {:?}/s, {} ms of warm-up then {} s measured each, delays 0-{} ms (names {name}.*)",
        params.rates, params.warm_up_ms, params.seconds, params.max_delay_ms
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
    let relay = RelayPath {
        exchange: format!("{name}.relay"),
        queue: format!("{name}.relay"),
        ready_exchange: config.amqp.ready_exchange.clone(),
        window: config.dispatch.window,
    };
    common::declare_exchange(&setup, &relay.exchange).await?;
    common::durable_queue(
        &setup,
        &relay.queue,
        &relay.exchange,
        common::commands_queue_args(&config.amqp),
    )
    .await?;
    let mut sink = common::sink(&connection, &sink_queue, true).await?;
    let mut bridge = Bridge::start(env, config)?;
    // Let it connect and declare before the clock starts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    bridge.check_alive()?;
    let producer = connection.create_channel().await?;
    producer
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let body = common::body(params.body_bytes);
    // Seeded: every run draws the same delays.
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let wait = Duration::from_millis(params.max_delay_ms) + Duration::from_secs(60);
    let mut results = Vec::new();
    for &rate in &params.rates {
        let publishing_s = params.seconds + params.warm_up_ms as f64 / 1000.0;
        let total = (rate as f64 * publishing_s).round() as u64;
        let label = format!("{rate}/s");
        // One schedule per rate, run through the bridge and then through the floor.
        let delays: Vec<i64> = (0..total)
            .map(|_| rng.random_range(0..=params.max_delay_ms) as i64)
            .collect();
        let schedule = Schedule {
            rate,
            delays: &delays,
            body: &body,
            deliver_at: params.deliver_at,
        };

        let start_us = common::now_us();
        let cpu = CpuMark::now();
        let bridge_cpu = bridge.cpu_seconds();
        let paced = schedule
            .publish(
                &producer,
                &config.amqp.commands_exchange,
                "bench",
                &format!("r{rate}"),
                &label,
            )
            .await?;
        let arrivals = collect(&mut sink, total, wait, Some(&mut bridge), &label).await?;
        let bridge_cpu = bridge
            .cpu_seconds()
            .zip(bridge_cpu)
            .map(|(end, start)| end - start);
        let busy = cpu.cores(bridge_cpu);
        let arrivals = params.steady(&arrivals, start_us);
        let vs_due_at = lateness_of(&arrivals, Arrival::vs_due_at_ms, "x-redisched-due-at")?;
        let vs_producer = lateness_of(&arrivals, Arrival::vs_producer_ms, "producer clock")?;
        let shift = lateness_of(&arrivals, apply_shift_ms, "apply shift")?;
        eprintln!(
            "\r  {label}: {} jobs; lateness vs due-at p50 {} / p99 {} / max {} ms, early {}; vs producer clock p50 {} / p99 {} / max {} ms, early {}      ",
            vs_due_at.stats.count,
            vs_due_at.stats.p50_ms,
            vs_due_at.stats.p99_ms,
            vs_due_at.stats.max_ms,
            vs_due_at.stats.early,
            vs_producer.stats.p50_ms,
            vs_producer.stats.p99_ms,
            vs_producer.stats.max_ms,
            vs_producer.stats.early
        );

        let floor = relay
            .floor(
                &env.amqp_url,
                &producer,
                &mut sink,
                &schedule,
                params,
                wait,
                &label,
            )
            .await?;
        eprintln!(
            "\r  {label} floor, two hops (publish -> relay queue -> timer -> publish -> consume, no Redis): vs producer clock p50 {} / p99 {} / max {} ms; its second hop alone: p50 {} / p99 {} / max {} ms; its first hop alone: p99 {} / max {} ms",
            floor.two_hop.stats.p50_ms,
            floor.two_hop.stats.p99_ms,
            floor.two_hop.stats.max_ms,
            floor.one_hop.stats.p50_ms,
            floor.one_hop.stats.p99_ms,
            floor.one_hop.stats.max_ms,
            floor.first_hop.p99_ms,
            floor.first_hop.max_ms
        );
        // The targets, on the producer's clock.
        let target = match rate {
            r if r <= 1000 => Some(10.0),
            r if r <= 5000 => Some(50.0),
            _ => None,
        };
        results.push(json!({
            "rate_per_s": rate,
            "jobs": total,
            "measured_jobs": arrivals.len(),
            "achieved_publish_rate_per_s": paced.achieved_rate.round(),
            "publisher_max_behind": paced.behind_max,
            "lateness_ms": vs_due_at.stats,
            "lateness_producer_clock_ms": vs_producer.stats,
            "apply_shift_ms": shift.stats,
            "floor_lateness_ms": floor.one_hop.stats,
            "floor_two_hop_lateness_ms": floor.two_hop.stats,
            "floor_first_hop_ms": floor.first_hop,
            "floor_publish_rate_per_s": floor.paced.achieved_rate.round(),
            "cores_busy": busy,
            "floor_cores_busy": floor.busy,
            "target_p99_ms": target,
            "target_applies_to": "lateness_producer_clock_ms",
            "cdf": cdf_points(&vs_due_at.sorted),
            "cdf_producer_clock": cdf_points(&vs_producer.sorted),
            "cdf_floor_two_hop": cdf_points(&floor.two_hop.sorted),
        }));
    }
    let rss = bridge.rss_kib();
    bridge.stop()?;
    sink.stop().await;
    let _ = connection.close(200, "bye".into()).await;
    Ok(json!({
        "seconds_per_rate": params.seconds,
        "warm_up_ms": params.warm_up_ms,
        "due_header": if params.deliver_at { "x-deliver-at (publish instant + delay, producer's clock)" } else { "x-delay" },
        "measured": "jobs whose producer-clock due time (publish + x-delay) falls in the last seconds_per_rate of publishing, after warm_up_ms: ingest and dispatch both at the full rate",
        "max_delay_ms": params.max_delay_ms,
        "body_bytes": params.body_bytes,
        "commands_queue": if config.amqp.quorum_queues { "quorum, single active consumer" } else { "classic, single active consumer" },
        "figures": {
            "lateness_ms": "arrival - x-redisched-due-at (the due time the bridge computed when it applied the command)",
            "lateness_producer_clock_ms": "arrival - (producer's publish instant + x-delay): what users feel; the targets apply to it",
            "apply_shift_ms": "x-redisched-due-at - (publish instant + x-delay): how far applying the command moved the due time ('early' counts negative shifts, from the store's ms resolution)",
            "floor_two_hop_lateness_ms": "same schedule, no Redis: publish -> relay queue (commands queue's arguments) -> relay holds until publish instant + delay -> publish (confirmed, persistent, mandatory, bridge's window) -> same consumer; vs the producer's clock",
            "floor_lateness_ms": "the second hop of that pass alone: relay timer -> publish -> consume, vs the relay's target time (ms); the one-hop floor",
            "floor_first_hop_ms": "the first hop of that pass alone: publish -> the relay's receipt (no-ack consumer), ms; the broker's share of what apply_shift_ms also holds (the relay's hold absorbs it, the bridge's due time does not: x-delay counts from when the command is applied)",
        },
        "bridge_rss_kib_after": rss,
        "rates": results,
    }))
}

impl Params {
    /// The arrivals of jobs due (on the producer's clock) in the measured seconds of a
    /// pass whose publishing started at `start_us` (module docs).
    fn steady(&self, arrivals: &[Arrival], start_us: i64) -> Vec<Arrival> {
        let window = self.measured(start_us);
        arrivals
            .iter()
            .filter(|a| a.producer_due_us.is_some_and(|due| window.contains(&due)))
            .copied()
            .collect()
    }

    /// The producer-clock due times (epoch µs) counted in a pass that started publishing
    /// at `start_us`: the `seconds` after the warm-up.
    fn measured(&self, start_us: i64) -> std::ops::Range<i64> {
        let from = start_us + self.warm_up_ms as i64 * 1000;
        from..from + (self.seconds * 1e6) as i64
    }

    /// The values of the messages due (on the producer's clock) in the measured seconds,
    /// as [`Self::steady`] picks arrivals.
    fn steady_values(&self, samples: &[(i64, f64)], start_us: i64) -> Vec<f64> {
        let window = self.measured(start_us);
        samples
            .iter()
            .filter(|(due, _)| window.contains(due))
            .map(|(_, value)| *value)
            .collect()
    }
}

/// One rate's schedule: job `i` is published at `i / rate` s with `delays[i]` ms.
struct Schedule<'a> {
    rate: u64,
    delays: &'a [i64],
    body: &'a [u8],
    /// `x-deliver-at` instead of `x-delay`.
    deliver_at: bool,
}

impl Schedule<'_> {
    /// Publishes the schedule as paced put commands (`common::publish_paced`).
    async fn publish(
        &self,
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
        id_prefix: &str,
        label: &str,
    ) -> Result<Paced> {
        let route = CommandRoute {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            id_prefix: id_prefix.to_string(),
            deliver_at: self.deliver_at,
        };
        let never = AtomicBool::new(false);
        let delays = self.delays.iter().copied();
        common::publish_paced(channel, &route, self.rate, delays, self.body, &never, label).await
    }
}

/// Waits for `total` deliveries on `sink` (within `wait`), checking the bridge if given.
async fn collect(
    sink: &mut Sink,
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
        match tokio::time::timeout(left, sink.arrivals.recv()).await {
            Ok(Some(arrival)) => arrivals.push(arrival),
            Ok(None) => bail!("the consumer stopped"),
            Err(_) => bail!("{label}: only {} of {total} jobs arrived", arrivals.len()),
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

/// One lateness figure: its percentiles and the sorted values (for the CDF).
struct Measured {
    stats: Lateness,
    sorted: Vec<f64>,
}

/// `figure` of every arrival; fails if one lacks the headers it needs.
fn lateness_of(
    arrivals: &[Arrival],
    figure: impl Fn(&Arrival) -> Option<f64>,
    what: &str,
) -> Result<Measured> {
    let mut values = arrivals
        .iter()
        .map(|a| figure(a).with_context(|| format!("a delivery without the headers of {what}")))
        .collect::<Result<Vec<f64>>>()?;
    let stats = Lateness::of(&mut values);
    Ok(Measured {
        stats,
        sorted: values,
    })
}

/// How far applying the command moved the due time: due-at minus the producer's due.
fn apply_shift_ms(arrival: &Arrival) -> Option<f64> {
    Some(arrival.due_at_ms? as f64 - arrival.producer_due_us? as f64 / 1000.0)
}

/// The two-hop floor's path: the relay's exchange and queue, where it publishes, and
/// its confirm window.
struct RelayPath {
    exchange: String,
    queue: String,
    ready_exchange: String,
    window: usize,
}

struct Floor {
    paced: Paced,
    /// Cores each process kept busy during the pass.
    busy: Value,
    two_hop: Measured,
    one_hop: Measured,
    /// The first hop alone (publish -> the relay's receipt): the broker's share of what
    /// the bridge's apply shift also holds.
    first_hop: Lateness,
}

impl RelayPath {
    /// Runs `schedule` through two broker hops and the relay (see the module docs).
    #[allow(clippy::too_many_arguments)]
    async fn floor(
        &self,
        amqp_url: &str,
        producer: &Channel,
        sink: &mut Sink,
        schedule: &Schedule<'_>,
        params: &Params,
        wait: Duration,
        label: &str,
    ) -> Result<Floor> {
        let relay = Relay::start(amqp_url, self).await?;
        let label = format!("{label} floor");
        // The relay stops whatever happens, so no task outlives the pass.
        let start_us = common::now_us();
        let cpu = CpuMark::now();
        let outcome = async {
            let paced = schedule
                .publish(producer, &self.exchange, "floor", "floor", &label)
                .await?;
            let arrivals = collect(sink, schedule.delays.len() as u64, wait, None, &label).await?;
            Ok::<_, anyhow::Error>((paced, arrivals))
        }
        .await;
        let busy = cpu.cores(None);
        let (refused, first_hops) = relay.stop().await;
        let (paced, arrivals) = outcome?;
        let arrivals = params.steady(&arrivals, start_us);
        let mut first_hop = params.steady_values(&first_hops, start_us);
        if refused > 0 {
            bail!("{label}: the broker refused {refused} of the relay's publishes");
        }
        Ok(Floor {
            paced,
            busy,
            two_hop: lateness_of(&arrivals, Arrival::vs_producer_ms, "producer clock")?,
            one_hop: lateness_of(&arrivals, Arrival::vs_due_at_ms, "relay due-at")?,
            first_hop: Lateness::of(&mut first_hop),
        })
    }
}

/// The floor's relay: consumes the relay queue, holds each message until its target
/// time, then publishes it like the bridge publishes a due job.
struct Relay {
    task: tokio::task::JoinHandle<Result<()>>,
    /// One connection for what comes in, one for what goes out.
    connections: [Connection; 2],
    refused: Arc<AtomicU64>,
    /// Per message received: (producer's due instant µs, publish -> receipt ms).
    first_hops: Arc<std::sync::Mutex<Vec<(i64, f64)>>>,
}

/// A held message: its target (epoch ms, for `x-redisched-due-at`), id and headers.
struct Held {
    due_at_ms: i64,
    properties: BasicProperties,
    body: Vec<u8>,
}

impl Relay {
    async fn start(amqp_url: &str, path: &RelayPath) -> Result<Self> {
        let incoming = common::amqp(amqp_url).await?;
        let outgoing = common::amqp(amqp_url).await?;
        let consume = incoming.create_channel().await?;
        let mut consumer = consume
            .basic_consume(
                path.queue.as_str().into(),
                "relay".into(),
                // Held in memory from receipt on, as the bridge holds a job in Redis
                // once applied: waiting for an ack would stall the queue for 10 s.
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("consume {}", path.queue))?;
        let publish = outgoing.create_channel().await?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let refused = Arc::new(AtomicU64::new(0));
        let permits = Arc::new(Semaphore::new(path.window));
        let (confirms, mut pending) = mpsc::unbounded_channel::<(
            lapin::PublisherConfirm,
            tokio::sync::OwnedSemaphorePermit,
        )>();
        let counted = refused.clone();
        tokio::spawn(async move {
            while let Some((confirm, _permit)) = pending.recv().await {
                if !matches!(confirm.await, Ok(lapin::Confirmation::Ack(None))) {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let channel = publish.clone();
        let exchange = path.ready_exchange.clone();
        let first_hops = Arc::new(std::sync::Mutex::new(Vec::new()));
        let hops = first_hops.clone();
        let task = tokio::spawn(async move {
            // Ordered by target instant, then by arrival (the sequence number).
            let mut held: BTreeMap<(tokio::time::Instant, u64), Held> = BTreeMap::new();
            let mut seq = 0u64;
            loop {
                let next = held.keys().next().map(|(at, _)| *at);
                tokio::select! {
                    delivery = consumer.next() => {
                        let Some(delivery) = delivery else { return Ok(()) };
                        let delivery = delivery?;
                        let now_us = common::now_us();
                        let producer_due_us =
                            common::int_header(&delivery.properties, common::PRODUCER_DUE_US_HEADER)
                                .context("a relayed message without the producer's due time")?;
                        if let Some(published_us) =
                            common::int_header(&delivery.properties, common::PUBLISHED_US_HEADER)
                        {
                            let hop_ms = (now_us - published_us) as f64 / 1000.0;
                            hops.lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .push((producer_due_us, hop_ms));
                        }
                        // Never before it arrived; whole ms, as the store keeps due times.
                        let due_at_ms = common::ceil_ms(producer_due_us.max(now_us));
                        let at = tokio::time::Instant::now()
                            + Duration::from_micros((due_at_ms * 1000 - now_us).max(0) as u64);
                        held.insert((at, seq), Held {
                            due_at_ms,
                            properties: delivery.properties.clone(),
                            body: delivery.data,
                        });
                        seq += 1;
                    }
                    _ = tokio::time::sleep_until(next.unwrap_or_else(tokio::time::Instant::now)), if next.is_some() => {
                        let now = tokio::time::Instant::now();
                        while let Some(entry) = held.first_entry() {
                            if entry.key().0 > now {
                                break;
                            }
                            let job = entry.remove();
                            let permit = permits.clone().acquire_owned().await?;
                            let confirm = channel
                                .basic_publish(
                                    exchange.as_str().into(),
                                    "floor".into(),
                                    BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() },
                                    &job.body,
                                    relayed_properties(&job),
                                )
                                .await?;
                            let _ = confirms.send((confirm, permit));
                        }
                    }
                }
            }
        });
        Ok(Self {
            task,
            connections: [incoming, outgoing],
            refused,
            first_hops,
        })
    }

    /// Stops relaying (every message of the pass has arrived by now) and returns how
    /// many publishes the broker refused, and the first hops it saw.
    async fn stop(self) -> (u64, Vec<(i64, f64)>) {
        self.task.abort();
        let _ = self.task.await;
        for connection in &self.connections {
            let _ = connection.close(200, "done".into()).await;
        }
        let hops = std::mem::take(
            &mut *self
                .first_hops
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        (self.refused.load(Ordering::Relaxed), hops)
    }
}

/// What the relay publishes: the bridge's output headers (topic, due-at, attempt), the
/// producer-clock headers passed through, persistent, the same message id.
fn relayed_properties(job: &Held) -> BasicProperties {
    let id = job
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_default();
    let mut headers = vec![
        (headers::TOPIC, common::text("floor")),
        (headers::DUE_AT, AMQPValue::LongLongInt(job.due_at_ms)),
        (headers::ATTEMPT, AMQPValue::LongLongInt(1)),
    ];
    for name in [common::PUBLISHED_US_HEADER, common::PRODUCER_DUE_US_HEADER] {
        if let Some(value) = common::int_header(&job.properties, name) {
            headers.push((name, AMQPValue::LongLongInt(value)));
        }
    }
    common::command_props(&id, &headers)
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

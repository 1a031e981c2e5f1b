//! Scenario 2 (ingest throughput) and the AMQP half of scenario 6 (deletes by id).
//!
//! N commands wait in the commands queue before the bridge starts; timed from its
//! start until the queue is empty and the store shows them applied. Ceiling, same run:
//! a plain lapin consumer with the bridge's prefetch that only acks, on a queue with
//! the same arguments filled by the same publishes (it is bound to the same exchange):
//! one ack per message (the stated ceiling), one multiple-ack per 100 messages, and the
//! honest ceiling for a store on Redis: a multiple-ack per 100 once those 100 were
//! written to the same Redis with one bare ZADD+HSET script each, pipelined, two
//! pipelines in flight ([`consume_write_and_ack`]).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures_util::stream::FuturesOrdered;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};
use redisched::job::Due;
use serde_json::{json, Value};

use super::common::{self, Bridge, Cleanup, Env, Series, Ticker};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Put commands (due in an hour, so dispatch stays idle).
    Put,
    /// Delete commands for jobs loaded beforehand through the store.
    Delete,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Put => "ingest",
            Kind::Delete => "cancel-amqp",
        }
    }
}

pub(super) struct Params {
    pub commands: u64,
    pub body_bytes: usize,
    /// `amqp.command_partitions` of the bridges (1: the one commands queue).
    pub partitions: u16,
    /// Bridge processes ingesting together; CPU and RSS are the first's.
    pub bridges: usize,
}

pub(super) async fn run(env: &Env, kind: Kind, params: &Params) -> Result<Value> {
    let mut config = common::bench_config(env, kind.label());
    config.amqp.command_partitions = params.partitions.max(1);
    let name = config.redis.prefix.clone();
    let mut cleanup = Cleanup::for_config(&config);
    for queue in ["ceiling1", "ceilingm", "ceilingr", "ceiling1b"] {
        cleanup.queues.push(format!("{name}.{queue}"));
    }
    eprintln!(
        "{}: {} commands, {} bridge(s), {} command partition(s) (names {name}.*)",
        kind.label(),
        params.commands,
        params.bridges.max(1),
        config.amqp.command_partitions
    );
    let result = measure(env, kind, params, &config, &name).await;
    cleanup.run().await;
    result
}

async fn measure(
    env: &Env,
    kind: Kind,
    params: &Params,
    config: &redisched::config::Config,
    name: &str,
) -> Result<Value> {
    let n = params.commands;
    let prefetch = config.ingest.prefetch;
    let connection = common::amqp(&env.amqp_url).await?;
    let setup = connection.create_channel().await?;
    redisched::amqp::declare_topology(&setup, &config.amqp).await?;
    // Same arguments as the commands queue (single active consumer, durable, and the
    // queue type the bridge declares).
    let args = common::commands_queue_args(&config.amqp);
    let single = format!("{name}.ceiling1");
    let multiple = format!("{name}.ceilingm");
    let with_redis = format!("{name}.ceilingr");
    let single_after = format!("{name}.ceiling1b");
    for queue in [&single, &multiple, &with_redis, &single_after] {
        common::durable_queue(&setup, queue, &config.amqp.commands_exchange, args.clone()).await?;
    }

    let store = common::store(config).await?;
    let topic = common::topic("bench")?;
    let body = common::body(params.body_bytes);
    if kind == Kind::Delete {
        common::load_jobs(
            &store,
            &topic,
            "job",
            n,
            &body,
            Due::Delay(3_600_000),
            "load jobs to delete",
        )
        .await?;
    }
    let publisher = connection.create_channel().await?;
    let command_body = if kind == Kind::Put {
        body.clone()
    } else {
        Vec::new()
    };
    common::publish_confirmed(
        &publisher,
        &config.amqp.commands_exchange,
        n,
        1000,
        "publish commands (5 queues)",
        |i| {
            let id = common::job_id("job", i);
            let props = match kind {
                Kind::Put => common::command_props(
                    &id,
                    &[(
                        redisched::job::headers::DELAY,
                        AMQPValue::LongLongInt(3_600_000),
                    )],
                ),
                Kind::Delete => common::command_props(
                    &id,
                    &[(redisched::job::headers::OP, common::text("delete"))],
                ),
            };
            ("bench".to_string(), props, command_body.clone())
        },
    )
    .await?;
    let _ = publisher.close(200, "done".into()).await;

    let mark = common::CpuMark::now();
    let (single_time, single_series) =
        consume_and_ack(&connection, &single, prefetch, n, 1).await?;
    let ceiling_cpu = mark.per_item(n, None);
    let (multiple_time, _) = consume_and_ack(&connection, &multiple, prefetch, n, 100).await?;
    let redis_time = consume_write_and_ack(&connection, &with_redis, prefetch, n, config).await?;
    let single_before = common::per_sec(n, single_time);
    let multiple_rate = common::per_sec(n, multiple_time);
    let redis_rate = common::per_sec(n, redis_time);
    eprintln!("  ceiling: {single_before:.0}/s one ack per message, {multiple_rate:.0}/s one multiple-ack per 100, {redis_rate:.0}/s that and a bare ZADD+HSET script per command");

    let mark = common::CpuMark::now();
    let mut bridge = Bridge::start(env, config)?;
    let others = (1..params.bridges)
        .map(|_| Bridge::start(env, config))
        .collect::<Result<Vec<_>>>()?;
    let started = bridge.started;
    let mut series = Series::default();
    series.sample(0.0, 0);
    let mut ticker = Ticker::new();
    let mut last_sample = Instant::now();
    let commands_queues = common::commands_queues(&config.amqp);
    loop {
        let records = store.stats(&topic).await?.records;
        let applied = match kind {
            Kind::Put => records,
            Kind::Delete => n.saturating_sub(records),
        };
        if last_sample.elapsed() >= Duration::from_millis(250) {
            last_sample = Instant::now();
            series.sample(started.elapsed().as_secs_f64(), applied);
            bridge.check_alive()?;
        }
        if ticker.due() {
            common::progress("applied", applied, n, started);
        }
        if applied >= n && common::queues_empty(&setup, &commands_queues).await? {
            common::progress_done("applied", applied, started);
            break;
        }
        if started.elapsed() > Duration::from_secs(900) {
            bail!("only {applied} of {n} commands applied after 900 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let bridge_time = started.elapsed();
    let bridge_cpu = mark.per_item(n, bridge.cpu_seconds());
    series.sample(bridge_time.as_secs_f64(), n);
    let rss = bridge.rss_kib();
    let cpu = bridge.cpu_seconds();
    bridge.stop()?;
    for other in others {
        other.stop()?;
    }
    // The one-ack ceiling again after the bridge (the machine is shared): the mean counts.
    let (single_after_time, _) =
        consume_and_ack(&connection, &single_after, prefetch, n, 1).await?;
    let single_after_rate = common::per_sec(n, single_after_time);
    let single_rate = (single_before + single_after_rate) / 2.0;
    let bridge_rate = common::per_sec(n, bridge_time);
    let ratio = common::ratio(bridge_rate, single_rate);
    eprintln!(
        "  bridge: {bridge_rate:.0} commands/s ({:.0}% of the one-ack ceiling, {:.0}% of the one with Redis writes)",
        ratio * 100.0,
        common::ratio(bridge_rate, redis_rate) * 100.0
    );
    let _ = connection.close(200, "bye".into()).await;
    Ok(json!({
        "commands": n,
        "op": if kind == Kind::Put { "put" } else { "delete" },
        "body_bytes": if kind == Kind::Put { params.body_bytes } else { 0 },
        "prefetch": prefetch,
        "batch": config.ingest.batch,
        "bridges": params.bridges.max(1),
        "command_partitions": config.amqp.command_partitions,
        "bridge": {
            "seconds": common::round2(bridge_time.as_secs_f64()),
            "commands_per_s": bridge_rate.round(),
            "rss_kib_after": rss,
            "cpu_seconds": cpu.map(common::round2),
            "cpu_per_command": bridge_cpu,
            "series": series.to_json(),
        },
        "ceiling": {
            "what": "lapin consumer, same prefetch and queue arguments, acks only",
            "one_ack_per_message_per_s": single_rate.round(),
            "one_ack_before_and_after_per_s": [single_before.round(), single_after_rate.round()],
            "multiple_ack_per_100_per_s": multiple_rate.round(),
            "multiple_ack_and_redis_per_100_per_s": redis_rate.round(),
            "cpu_per_msg_one_ack": ceiling_cpu,
            "series": single_series.to_json(),
        },
        "ratio": common::round2(ratio),
        "ratio_to_multiple_ack": common::round2(common::ratio(bridge_rate, multiple_rate)),
        "ratio_to_redis_ceiling": common::round2(common::ratio(bridge_rate, redis_rate)),
        "target_ratio": 0.8,
    }))
}

/// Consumes `n` messages with `prefetch`, acking every `ack_every`-th (multiple) or each.
async fn consume_and_ack(
    connection: &Connection,
    queue: &str,
    prefetch: u16,
    n: u64,
    ack_every: u64,
) -> Result<(Duration, Series)> {
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let label = if ack_every == 1 {
        "ceiling: consume + ack each".to_string()
    } else {
        format!("ceiling: consume + multiple-ack per {ack_every}")
    };
    let started = Instant::now();
    let mut consumer = consume(&channel, queue).await?;
    let mut series = Series::default();
    series.sample(0.0, 0);
    let mut ticker = Ticker::new();
    let mut last_sample = Instant::now();
    let mut got = 0u64;
    while got < n {
        let delivery = next_delivery(&mut consumer, queue, got, n).await?;
        got += 1;
        if got.is_multiple_of(ack_every) || got == n {
            delivery
                .acker
                .ack(BasicAckOptions {
                    multiple: ack_every > 1,
                })
                .await?;
        }
        if last_sample.elapsed() >= Duration::from_millis(250) {
            last_sample = Instant::now();
            series.sample(started.elapsed().as_secs_f64(), got);
        }
        if ticker.due() {
            common::progress(&label, got, n, started);
        }
    }
    let elapsed = started.elapsed();
    series.sample(elapsed.as_secs_f64(), n);
    common::progress_done(&label, n, started);
    let _ = channel.close(200, "done".into()).await;
    Ok((elapsed, series))
}

/// Starts consuming `queue` (manual acks) on `channel`.
async fn consume(channel: &Channel, queue: &str) -> Result<Consumer> {
    channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("consume {queue}"))
}

/// The least a store on Redis does per command: this one script, on two keys.
const BARE_WRITE: &str =
    "redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1]) redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) return 1";

/// Per-batch size of [`consume_write_and_ack`], the multiple-ack ceiling's.
const REDIS_BATCH: u64 = 100;

/// Consumes `n` messages with `prefetch`; for each 100, one pipeline of a bare
/// ZADD+HSET script per message (id = `message_id`, score = now + an hour, value = the
/// body) into the bridge's Redis, then one multiple-ack once that pipeline answered. Two
/// pipelines in flight, as the bridge applies two batches at once; acks in order.
async fn consume_write_and_ack(
    connection: &Connection,
    queue: &str,
    prefetch: u16,
    n: u64,
    config: &redisched::config::Config,
) -> Result<Duration> {
    let client = redis::Client::open(config.redis.url.as_str())?;
    let mut redis = client.get_multiplexed_async_connection().await?;
    let sha: String = redis::Script::new(BARE_WRITE)
        .prepare_invoke()
        .load_async(&mut redis)
        .await?;
    let prefix = &config.redis.prefix;
    let (scheduled, jobs) = (
        format!("{prefix}:{{ceiling}}:scheduled"),
        format!("{prefix}:{{ceiling}}:jobs"),
    );
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let label = "ceiling: consume + Redis write + multiple-ack per 100";
    let started = Instant::now();
    let mut consumer = consume(&channel, queue).await?;
    let score = common::now_us() / 1000 + 3_600_000;
    let mut in_flight = FuturesOrdered::new();
    let mut pipe = redis::pipe();
    let mut ticker = Ticker::new();
    let mut got = 0u64;
    while got < n {
        let delivery = next_delivery(&mut consumer, queue, got, n).await?;
        got += 1;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .unwrap_or_default();
        pipe.cmd("EVALSHA")
            .arg(&sha)
            .arg(2)
            .arg(&scheduled)
            .arg(&jobs)
            .arg(id)
            .arg(score)
            .arg(delivery.data.as_slice());
        if got.is_multiple_of(REDIS_BATCH) || got == n {
            if in_flight.len() >= 2 {
                ack_written(&mut in_flight).await?;
            }
            let batch = std::mem::replace(&mut pipe, redis::pipe());
            let mut redis = redis.clone();
            let acker = delivery.acker.clone();
            in_flight.push_back(async move {
                batch.query_async::<()>(&mut redis).await.map(|()| acker)
            });
        }
        if ticker.due() {
            common::progress(label, got, n, started);
        }
    }
    while !in_flight.is_empty() {
        ack_written(&mut in_flight).await?;
    }
    let elapsed = started.elapsed();
    common::progress_done(label, n, started);
    let _ = channel.close(200, "done".into()).await;
    Ok(elapsed)
}

/// Waits for the oldest pipeline in flight and acks its batch (multiple).
/// The ceiling consumers' next delivery; an error if none comes within 60 s.
async fn next_delivery(
    consumer: &mut Consumer,
    queue: &str,
    got: u64,
    n: u64,
) -> Result<lapin::message::Delivery> {
    match tokio::time::timeout(Duration::from_secs(60), consumer.next()).await {
        Ok(Some(delivery)) => Ok(delivery?),
        Ok(None) => bail!("consumer on {queue} ended"),
        Err(_) => bail!("no message on {queue} for 60 s ({got} of {n})"),
    }
}

async fn ack_written<F>(in_flight: &mut FuturesOrdered<F>) -> Result<()>
where
    F: std::future::Future<Output = redis::RedisResult<lapin::Acker>>,
{
    let acker = in_flight
        .next()
        .await
        .context("a pipeline in flight")?
        .context("bare write pipeline")?;
    acker.ack(BasicAckOptions { multiple: true }).await?;
    Ok(())
}

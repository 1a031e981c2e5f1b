//! Scaling out: many topics, a hot topic beside cold ones, quorum queues.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use common::bridge::*;
use common::faults::PrivateRedis;
use lapin::types::AMQPValue;
use redisched::job::Due;
use redisched::store::{ConnectOptions, Op, Store};
use redisched_testkit::percentile;

/// Calls of one command so far on a private server (INFO commandstats), so the counts
/// are this test's alone.
fn calls(redis: &PrivateRedis, command: &str) -> u64 {
    redis
        .info_field("commandstats", &format!("cmdstat_{command}"))
        .and_then(|stats| {
            stats
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

async fn store_at(url: &str, prefix: &str) -> Store {
    let options = ConnectOptions {
        url: url.into(),
        prefix: prefix.into(),
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(10),
        tls_ca_file: None,
    };
    Store::connect(&options, common::DEFAULT_LIMITS)
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_live_topics_cost_a_bounded_number_of_calls_per_tick() {
    let _shared = common::timed::shared().await;
    let redis = PrivateRedis::start();
    let mut config = test_config("topics");
    config.redis.url = redis.url();
    config.dispatch.poll_interval_ms = 500;
    config.dispatch.requeue_interval_ms = 1_000;
    let store = store_at(&redis.url(), &config.redis.prefix).await;
    let topics = 10_000;
    // One far-future job per topic: all live, none due during the idle phase.
    for chunk in (0..topics).collect::<Vec<_>>().chunks(1000) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|i| common::put_op(&format!("idle.{i}"), "j", Due::Delay(3_600_000)))
            .collect();
        store.apply(&ops).await.expect("load idle topics");
    }
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    tokio::time::sleep(Duration::from_secs(2)).await; // the start-up full pass

    // Every per-topic look is one ZRANGE (plain, or inside requeue.lua).
    let before = calls(&redis, "zrange");
    let idle = Duration::from_secs(4);
    tokio::time::sleep(idle).await;
    let per_second = (calls(&redis, "zrange") - before) as f64 / idle.as_secs_f64();
    let rescans = 1000.0 / config.dispatch.poll_interval_ms as f64;
    let requeues = 1000.0 / config.dispatch.requeue_interval_ms as f64;
    let bound = (redisched::dispatch::RESCAN_CHUNK as f64 * rescans
        + redisched::requeue::CHUNK as f64 * requeues)
        * 1.5;
    println!(
        "idle with {topics} live topics: {per_second:.0} per-topic calls/s (bound {bound:.0})"
    );
    assert!(
        per_second <= bound,
        "{per_second} calls/s: a tick looks at every topic"
    );

    // Lateness with all those topics live: 2,000 jobs on 2,000 of them, due in 1–3 s.
    let n = 2_000;
    let ops: Vec<Op> = (0..n)
        .map(|i| {
            common::put_op(
                &format!("idle.{}", i * 5),
                &format!("due-{i}"),
                Due::Delay(1_000 + (i as i64 % 2_000)),
            )
        })
        .collect();
    store.apply(&ops).await.expect("due jobs");
    let got = ready.collect(n, Duration::from_secs(30)).await;
    assert_eq!(got.len(), n, "every due job delivered");
    let mut lateness: Vec<i64> = got
        .iter()
        .map(|(arrived, d)| arrived - header_i64(d, "x-redisched-due-at").unwrap_or(i64::MAX))
        .collect();
    lateness.sort();
    assert!(lateness[0] >= 0, "never early");
    println!(
        "lateness with {topics} live topics: p50 {} ms, p99 {} ms, max {} ms",
        percentile(&lateness, 0.5),
        percentile(&lateness, 0.99),
        lateness[lateness.len() - 1]
    );
    assert!(
        percentile(&lateness, 0.99) < 1_000,
        "p99 lateness under a second"
    );
    bridge.stop().await;
    let _ = broker.connection.close(200, "bye".into()).await;
    let mut config_for_cleanup = config.clone();
    config_for_cleanup.redis.url = common::redis_url();
    Broker::new(&config_for_cleanup).await.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_topic_does_not_starve_the_others() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("fair");
    config.dispatch.window = 200;
    let store = common::test_store_named(&config.redis.prefix).await;
    let hot = 10_000;
    for chunk in (0..hot).collect::<Vec<_>>().chunks(1000) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|i| common::put_op("hot", &format!("hot-{i}"), Due::NOW))
            .collect();
        store.apply(&ops).await.expect("hot backlog");
    }
    let cold: Vec<Op> = (0..20)
        .map(|i| common::put_op(&format!("cold.{i}"), "c", Due::NOW))
        .collect();
    store.apply(&cold).await.expect("cold jobs");

    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    let got = ready.collect(hot + 20, Duration::from_secs(60)).await;
    assert_eq!(got.len(), hot + 20);
    let last_cold = got
        .iter()
        .rposition(|(_, d)| d.routing_key.as_str().starts_with("cold."))
        .expect("cold jobs delivered");
    println!(
        "the last cold job arrived at position {last_cold} of {}",
        got.len()
    );
    assert!(
        last_cold < 2_000,
        "cold topics waited behind the hot backlog (position {last_cold})"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_carry_commands_and_invalid_ones() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("quorum");
    config.amqp.quorum_queues = true;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let bridge = InProcess::start(&config);
    for i in 0..50 {
        broker
            .put(
                "q",
                &format!("job-{i}"),
                b"x",
                &[("x-delay", AMQPValue::LongInt(i * 10))],
            )
            .await;
    }
    broker
        .put("q", "bad", b"x", &[("x-delay", text("never"))])
        .await;
    let got = ready.collect(50, Duration::from_secs(20)).await;
    let ids: HashSet<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    assert_eq!(ids.len(), 50);
    let (_, bad) = invalid
        .next(Duration::from_secs(10))
        .await
        .expect("set aside");
    assert_eq!(message_id(&bad), "bad");
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_bridges_share_the_work_and_survive_losing_one() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("three");
    config.dispatch.ttr_ms = 1_000;
    config.dispatch.batch = 50;
    let store = common::test_store_named(&config.redis.prefix).await;
    let n = 6_000;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|i| common::put_op(&format!("three.{}", i % 10), &format!("job-{i}"), Due::NOW))
            .collect();
        store.apply(&ops).await.expect("load");
    }
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut bridges: Vec<ChildBridge> = (0..3).map(|_| ChildBridge::start(&config)).collect();
    let first = ready.collect(500, Duration::from_secs(30)).await;
    assert_eq!(first.len(), 500, "the bridges started");
    bridges[0].kill9();
    let mut got = first;
    let mut ids: HashSet<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    while ids.len() < n {
        let Some(delivery) = ready.next(Duration::from_secs(20)).await else {
            break;
        };
        ids.insert(message_id(&delivery.1));
        got.push(delivery);
    }
    assert_eq!(ids.len(), n, "nothing lost when one of three bridges dies");
    // Stragglers: redeliveries of the killed bridge's unreleased jobs.
    got.extend(ready.drain(Duration::from_secs(2)).await);
    let duplicates = got.len() - ids.len();
    println!("three bridges, one killed: {n} jobs, {duplicates} duplicates");
    assert!(
        duplicates <= config.dispatch.window,
        "duplicates bounded by one bridge's window"
    );
    for bridge in bridges.iter_mut().skip(1) {
        let (status, _) = bridge.terminate();
        assert!(status.success());
    }
    broker.cleanup().await;
}

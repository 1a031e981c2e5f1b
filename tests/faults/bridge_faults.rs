//! Faults: the bridge under a Redis crash, a broker restart, a resource
//! alarm, network cuts and hangs, SIGKILL mid-ingest and SIGTERM under load. Each test
//! asserts the promise: every job whose put the broker confirmed (and that was not
//! deleted) is delivered at least once, never early; duplicates are counted, printed
//! and bounded.
//!
//! Isolation: the shared Redis and RabbitMQ are never stopped or alarmed. Redis crashes
//! happen to a private `redis-server` (AOF, `appendfsync always`), broker restarts and
//! alarms to a private RabbitMQ node (7-9 s to start on a 2-core machine), network faults to
//! a TCP proxy owned by the test. All tests may run in parallel with the other test
//! files. Figures are printed (`cargo test --test faults bridge_faults:: -- --nocapture`).

use crate::common;

use std::time::{Duration, Instant};

use common::bridge::*;
use common::faults::*;
use tokio_util::sync::CancellationToken;

const SECOND: Duration = Duration::from_secs(1);

/// Milliseconds from `since` to the first delivery after it, waiting up to `timeout`.
async fn recovery_ms(collector: &Collector, since: i64, timeout: Duration) -> Option<i64> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(at) = collector.first_since(since) {
            return Some(at - since);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    None
}

async fn take_ledger(load: tokio::task::JoinHandle<Producer>) -> Ledger {
    let mut producer = load.await.expect("load task");
    producer.close().await;
    let mut ledger = producer.ledger.lock().unwrap();
    std::mem::take(&mut *ledger)
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn redis_sigkill_and_restart_under_load_loses_nothing() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let mut redis = PrivateRedis::start();
        let mut config = fault_config("rkill");
        config.redis.url = redis.url();
        let amqp = common::amqp_url();
        let _cleanup = AmqpCleanup {
            url: amqp.clone(),
            config: config.clone(),
        };
        let collector = Collector::start(&amqp, &config).await;
        let bridge = InProcess::start(&config);
        let stop = CancellationToken::new();
        let load = spawn_load(
            Producer::new(&amqp, &config),
            20,
            1_000,
            Duration::from_millis(50),
            stop.clone(),
        );

        tokio::time::sleep(2 * SECOND).await;
        let kills = 2;
        for round in 1..=kills {
            redis.kill9();
            tokio::time::sleep(1500 * Duration::from_millis(1)).await;
            assert!(
                !bridge.handle.is_finished(),
                "the bridge stopped while Redis was down"
            );
            redis.restart();
            let back = now_ms();
            let recovered = recovery_ms(&collector, back, 30 * SECOND).await;
            println!("[rkill] round {round}: Redis down 1.5 s; first delivery {recovered:?} ms after restart");
            assert!(
                recovered.is_some(),
                "no delivery within 30 s of the Redis restart"
            );
            tokio::time::sleep(SECOND).await;
        }
        stop.cancel();
        let ledger = take_ledger(load).await;
        let complete = collector.wait_for_all(&ledger, 60 * SECOND).await;
        tokio::time::sleep(SECOND).await;
        assert!(!bridge.handle.is_finished(), "the bridge is still running");
        bridge.stop().await;
        let seen = collector.stop().await;
        let report = verify("rkill", &ledger, &seen);
        assert!(complete || !report.lost.is_empty());
        assert_promise(&report, dup_bound(&config, kills), "");
    });
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn rabbitmq_restart_under_load_loses_nothing() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let node = PrivateRabbit::start().unwrap_or_else(|e| panic!("private RabbitMQ node: {e}"));
        println!(
            "[mqrestart] private node {} up in {:?}",
            node.node, node.started_in
        );
        let mut config = fault_config("mqrestart");
        config.amqp.url = node.url();
        let store = common::test_store_owning(&config.redis.prefix).await;
        let collector = Collector::start(&node.url(), &config).await;
        let bridge = InProcess::start(&config);
        let stop = CancellationToken::new();
        let load = spawn_load(
            Producer::new(&node.url(), &config),
            20,
            1_000,
            Duration::from_millis(50),
            stop.clone(),
        );

        tokio::time::sleep(2 * SECOND).await;
        node.ctl_ok(&["stop_app"]);
        tokio::time::sleep(2 * SECOND).await;
        assert!(
            !bridge.handle.is_finished(),
            "the bridge stopped while the broker was down"
        );
        node.ctl_ok(&["start_app"]);
        let back = now_ms();
        let recovered = recovery_ms(&collector, back, 30 * SECOND).await;
        println!("[mqrestart] broker app down ~2 s; first delivery {recovered:?} ms after start_app returned");
        assert!(
            recovered.is_some(),
            "no delivery within 30 s of the broker restart"
        );
        tokio::time::sleep(2 * SECOND).await;
        stop.cancel();
        let ledger = take_ledger(load).await;
        collector.wait_for_all(&ledger, 60 * SECOND).await;
        tokio::time::sleep(SECOND).await;
        assert!(!bridge.handle.is_finished(), "the bridge is still running");
        bridge.stop().await;
        let seen = collector.stop().await;
        drop(store);
        let report = verify("mqrestart", &ledger, &seen);
        assert_promise(&report, dup_bound(&config, 1), "");
    });
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn resource_alarm_pauses_dispatch_and_loses_nothing() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let node = PrivateRabbit::start().unwrap_or_else(|e| panic!("private RabbitMQ node: {e}"));
        println!(
            "[alarm] private node {} up in {:?}",
            node.node, node.started_in
        );
        let mut config = fault_config("alarm");
        config.amqp.url = node.url();
        let store = common::test_store_owning(&config.redis.prefix).await;
        let collector = Collector::start(&node.url(), &config).await;
        let bridge = InProcess::start(&config);
        // Everything is published before the alarm (the alarm blocks this producer too),
        // due over the next 8 s, so that jobs come due while publishers are blocked.
        let mut producer = Producer::new(&node.url(), &config);
        let publishing = Instant::now();
        let mut confirmed = 0;
        for _ in 0..20 {
            confirmed += producer.batch(100, 8_000, 1).await;
        }
        println!(
            "[alarm] {confirmed} of 2,000 puts confirmed in {:?}; delivered so far: {}",
            publishing.elapsed(),
            collector.count()
        );
        // And a last batch due 12-13 s from now, held until the alarm has covered it:
        // jobs that must wait for the alarm to clear however long the publishing above
        // and `rabbitmqctl` take (on a loaded machine, seconds each).
        let held = producer.batch_between(100, 12_000, 13_000, 0).await;
        let held_due = now_ms() + 13_000;
        assert!(
            held > 0,
            "none of the last batch was confirmed before the alarm"
        );
        producer.close().await;
        tokio::time::sleep(SECOND).await;

        node.ctl_ok(&["set_vm_memory_high_watermark", "0.0000001"]);
        let alarmed = now_ms();
        tokio::time::sleep(2 * SECOND).await;
        let paused_from = now_ms();
        let hold_until = (held_due + 1_000).max(paused_from + 3_000);
        let hold_ms = u64::try_from(hold_until - paused_from).unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(hold_ms)).await;
        let during = collector.count_since(paused_from);
        assert!(
            !bridge.handle.is_finished(),
            "the bridge stopped under the alarm"
        );
        node.ctl_ok(&["set_vm_memory_high_watermark", "0.4"]);
        let restored = now_ms();
        let recovered = recovery_ms(&collector, restored, 30 * SECOND).await;
        println!(
            "[alarm] alarm for {} ms; deliveries in its last {} ms: {during}; \
             first delivery {recovered:?} ms after it cleared",
            restored - alarmed,
            restored - paused_from
        );
        assert!(
            recovered.is_some(),
            "dispatch did not resume within 30 s of the alarm clearing"
        );
        assert_eq!(during, 0, "dispatch is paused while publishers are blocked");

        let ledger = std::mem::take(&mut *producer.ledger.lock().unwrap());
        collector.wait_for_all(&ledger, 60 * SECOND).await;
        tokio::time::sleep(SECOND).await;
        bridge.stop().await;
        let seen = collector.stop().await;
        drop(store);
        let report = verify("alarm", &ledger, &seen);
        assert_promise(&report, dup_bound(&config, 1), "");
    });
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn network_cuts_and_hangs_between_bridge_and_services_lose_nothing() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let redis_proxy = Proxy::start(socket_addr(&common::redis_url())).await;
        let amqp_proxy = Proxy::start(socket_addr(&common::amqp_url())).await;
        let mut config = fault_config("net");
        config.redis.url = redis_proxy.redis_url();
        config.amqp.url = amqp_proxy.amqp_url();
        let amqp = common::amqp_url();
        let _cleanup = AmqpCleanup {
            url: amqp.clone(),
            config: config.clone(),
        };
        let store = common::test_store_owning(&config.redis.prefix).await;
        let collector = Collector::start(&amqp, &config).await;
        let bridge = InProcess::start(&config);
        let stop = CancellationToken::new();
        let load = spawn_load(
            Producer::new(&amqp, &config),
            20,
            1_000,
            Duration::from_millis(50),
            stop.clone(),
        );
        tokio::time::sleep(2 * SECOND).await;

        // 1. Every connection dropped, new ones refused, for 2 s.
        step("net", "1: cut for 2 s");
        redis_proxy.cut();
        amqp_proxy.cut();
        tokio::time::sleep(2 * SECOND).await;
        redis_proxy.restore();
        amqp_proxy.restore();
        let at = now_ms();
        let cut = recovery_ms(&collector, at, 30 * SECOND).await;
        println!("[net] cut 2 s: first delivery {cut:?} ms after restore");
        assert!(cut.is_some(), "no recovery within 30 s of a cut");
        tokio::time::sleep(SECOND).await;

        step("net", "2: everything held for 5 s");
        // 2. Everything hangs (bytes held, new connections hang too) for 5 s: longer than
        //    two heartbeats and than the Redis response timeout.
        redis_proxy.hold();
        amqp_proxy.hold();
        tokio::time::sleep(5 * SECOND).await;
        assert!(
            !bridge.handle.is_finished(),
            "the bridge stopped during the hang"
        );
        redis_proxy.restore();
        amqp_proxy.restore();
        let at = now_ms();
        let hang = recovery_ms(&collector, at, 30 * SECOND).await;
        println!("[net] hang 5 s: first delivery {hang:?} ms after restore");
        assert!(hang.is_some(), "no recovery within 30 s of a hang");
        tokio::time::sleep(SECOND).await;

        step("net", "3: Redis connections frozen");
        // 3. Half-open: the Redis connections in use hang forever, new ones work. Deliveries
        //    arriving more than 0.5 s later went through a new Redis connection.
        redis_proxy.freeze_existing();
        let at = now_ms();
        let redis_frozen = recovery_ms(&collector, at + 500, 30 * SECOND).await;
        println!("[net] Redis connections frozen: first delivery {redis_frozen:?} ms after 0.5 s");
        assert!(
            redis_frozen.is_some(),
            "the bridge hangs on a dead Redis connection"
        );
        tokio::time::sleep(SECOND).await;

        step("net", "4: AMQP connection frozen");
        // 4. Half-open AMQP connection: heartbeats must detect it.
        amqp_proxy.freeze_existing();
        let at = now_ms();
        let amqp_frozen = recovery_ms(&collector, at + 500, 30 * SECOND).await;
        println!("[net] AMQP connection frozen: first delivery {amqp_frozen:?} ms after 0.5 s");
        assert!(
            amqp_frozen.is_some(),
            "the bridge hangs on a dead AMQP connection"
        );
        tokio::time::sleep(2 * SECOND).await;

        step("net", "5: load stopped; waiting for every delivery");
        stop.cancel();
        let ledger = take_ledger(load).await;
        collector.wait_for_all(&ledger, 60 * SECOND).await;
        tokio::time::sleep(SECOND).await;
        assert!(!bridge.handle.is_finished(), "the bridge is still running");
        step("net", "6: graceful stop");
        let took = bridge.stop().await;
        println!("[net] graceful stop took {took:?}");
        step("net", "7: collector stopped, verdict");
        let seen = collector.stop().await;
        drop(store);
        let report = verify("net", &ledger, &seen);
        assert_promise(&report, dup_bound(&config, 4), "");
        step("net", "ended");
    });
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn sigkill_during_ingest_loses_nothing() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let config = fault_config("ingkill");
        let amqp = common::amqp_url();
        let _cleanup = AmqpCleanup {
            url: amqp.clone(),
            config: config.clone(),
        };
        let dir = TempDir::new("ingkill");
        let log = dir.path().join("bridge.log");
        let store = common::test_store_owning(&config.redis.prefix).await;
        let collector = Collector::start(&amqp, &config).await;
        // Commands wait in the queue before the bridge starts.
        let mut producer = Producer::new(&amqp, &config);
        for _ in 0..40 {
            producer.batch(100, 500, 1).await;
        }
        let probe = connect().await;
        let probe = probe.create_channel().await.expect("channel");
        let queued = queue_depth(&probe, &config.amqp.commands_queue)
            .await
            .expect("queue depth");
        println!("[ingkill] {queued} commands queued");

        let mut bridge = spawn_bridge(&config, &log);
        let mut kills = 0;
        for fraction in [0.7, 0.35] {
            let threshold = (f64::from(queued) * fraction) as u32;
            let deadline = Instant::now() + 60 * SECOND;
            loop {
                let depth = queue_depth(&probe, &config.amqp.commands_queue)
                    .await
                    .unwrap_or(u32::MAX);
                if depth <= threshold {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "ingest made no progress:\n{}",
                    tail(&log, 30)
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            bridge.kill9();
            kills += 1;
            println!("[ingkill] SIGKILL with about {threshold} commands left");
            bridge = spawn_bridge(&config, &log);
        }
        let ledger = std::mem::take(&mut *producer.ledger.lock().unwrap());
        producer.close().await;
        collector.wait_for_all(&ledger, 60 * SECOND).await;
        tokio::time::sleep(SECOND).await;
        let (status, took) = bridge.terminate();
        let seen = collector.stop().await;
        drop(store);
        let report = verify("ingkill", &ledger, &seen);
        assert_promise(&report, dup_bound(&config, kills), &tail(&log, 40));
        assert!(
            status.success(),
            "SIGTERM exits 0, got {status:?}\n{}",
            tail(&log, 40)
        );
        assert!(took < 10 * SECOND, "shutdown took {took:?}");
    });
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn sigterm_under_load_exits_zero_and_unconfirmed_jobs_are_redelivered() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let amqp_proxy = Proxy::start(socket_addr(&common::amqp_url())).await;
        let mut config = fault_config("term");
        config.amqp.url = amqp_proxy.amqp_url();
        config.amqp.heartbeat_secs = 10;
        config.dispatch.ttr_ms = 2_000;
        let amqp = common::amqp_url();
        let _cleanup = AmqpCleanup {
            url: amqp.clone(),
            config: config.clone(),
        };
        let dir = TempDir::new("term");
        let log = dir.path().join("bridge.log");
        let store = common::test_store_owning(&config.redis.prefix).await;
        let collector = Collector::start(&amqp, &config).await;
        let stop = CancellationToken::new();
        let load = spawn_load(
            Producer::new(&amqp, &config),
            20,
            500,
            Duration::from_millis(30),
            stop.clone(),
        );
        let grace = Duration::from_millis(config.dispatch.shutdown_grace_ms);

        // 1. SIGTERM while commands and jobs flow.
        let mut bridge = spawn_bridge(&config, &log);
        tokio::time::sleep(3 * SECOND).await;
        let (status, took) = bridge.terminate();
        println!("[term] SIGTERM under load: {status:?} after {took:?}");
        assert!(
            status.success(),
            "exit 0 after SIGTERM, got {status:?}\n{}",
            tail(&log, 40)
        );
        assert!(
            took < grace + 5 * SECOND,
            "shutdown took {took:?}\n{}",
            tail(&log, 40)
        );

        // 2. SIGTERM while the broker does not answer: publishes stay unconfirmed. The
        //    bridge must still exit in bounded time; the next one redelivers those jobs.
        let mut bridge = spawn_bridge(&config, &log);
        tokio::time::sleep(3 * SECOND).await;
        amqp_proxy.hold();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (status, took) = bridge.terminate();
        println!("[term] SIGTERM with the broker hung: {status:?} after {took:?}");
        amqp_proxy.restore();
        assert!(
            status.success(),
            "exit 0 after SIGTERM, got {status:?}\n{}",
            tail(&log, 40)
        );
        // Bounded by the grace period plus two close timeouts, not by the heartbeat.
        assert!(
            took < grace + 5 * SECOND,
            "shutdown with a hung broker took {took:?}\n{}",
            tail(&log, 40)
        );
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            logged.contains("confirms still pending at the end of the grace period"),
            "the hung broker left publishes unconfirmed at shutdown\n{}",
            tail(&log, 40)
        );

        let mut bridge = spawn_bridge(&config, &log);
        tokio::time::sleep(2 * SECOND).await;
        stop.cancel();
        let ledger = take_ledger(load).await;
        collector.wait_for_all(&ledger, 60 * SECOND).await;
        tokio::time::sleep(SECOND).await;
        let (status, _) = bridge.terminate();
        let seen = collector.stop().await;
        drop(store);
        let report = verify("term", &ledger, &seen);
        assert_promise(&report, dup_bound(&config, 2), &tail(&log, 40));
        assert!(status.success());
    });
}

/// Two in-process bridges on one commands queue: A (registered first, so the
/// single-active-consumer queue feeds it) reaches Redis and the broker through proxies,
/// B directly. For the stale-ingest cases found by `tests/chaos.rs`.
struct Handover {
    redis_proxy: Proxy,
    amqp_proxy: Proxy,
    broker: Broker,
    ready: Receiver,
    replies: Receiver,
    reply_queue: String,
    a: Option<InProcess>,
    b: InProcess,
    _cleanup: AmqpCleanup,
    _store: common::TestStore,
}

impl Handover {
    async fn start(label: &str) -> Self {
        init_logging();
        let redis_proxy = Proxy::start(socket_addr(&common::redis_url())).await;
        let amqp_proxy = Proxy::start(socket_addr(&common::amqp_url())).await;
        let config = fault_config(label);
        let mut behind_proxies = config.clone();
        behind_proxies.redis.url = redis_proxy.redis_url();
        behind_proxies.amqp.url = amqp_proxy.amqp_url();
        let _cleanup = AmqpCleanup {
            url: common::amqp_url(),
            config: config.clone(),
        };
        let _store = common::test_store_owning(&config.redis.prefix).await;
        let broker = Broker::new(&config).await;
        let ready = broker.consume_ready("#").await;
        let reply_queue = common::unique("replies");
        broker.declare_queue(&reply_queue).await;
        let replies = broker.consume_queue(&reply_queue).await;
        let a = InProcess::start(&behind_proxies);
        tokio::time::sleep(SECOND).await;
        let b = InProcess::start(&config);
        tokio::time::sleep(SECOND).await;
        Self {
            redis_proxy,
            amqp_proxy,
            broker,
            ready,
            replies,
            reply_queue,
            a: Some(a),
            b,
            _cleanup,
            _store,
        }
    }

    /// A command for job `y` on topic `t`, answered on the reply queue.
    async fn command(&self, headers: &[(&str, lapin::types::AMQPValue)], body: &[u8]) {
        let props = props("y", headers).with_reply_to(self.reply_queue.as_str().into());
        self.broker.command("t", props, body).await;
    }

    /// Due 6 s after B applies it: after the delete, with room for A's stop, and before
    /// `assert_nothing_delivered` stops looking.
    async fn put_due_in_6s(&self) {
        let delay = ("x-delay", lapin::types::AMQPValue::LongLongInt(6_000));
        self.command(&[delay], b"v1").await;
    }

    async fn delete(&self) {
        self.command(&[("x-redisched-op", text("delete"))], b"")
            .await;
    }

    /// The bridge answered the put and then the delete (B applied both, in order).
    async fn assert_put_then_delete_applied(&mut self) {
        let answers: Vec<String> = self
            .replies
            .collect(2, 10 * SECOND)
            .await
            .iter()
            .map(|(_, d)| String::from_utf8_lossy(&d.data).into_owned())
            .collect();
        assert!(
            answers.len() == 2 && answers[1].contains("\"deleted\""),
            "B applied the redelivered put, then the delete: {answers:?}"
        );
    }

    /// Nothing may be delivered once the delete was applied; stops both bridges.
    async fn assert_nothing_delivered(mut self) {
        let late = self.ready.drain(8 * SECOND).await;
        if let Some(a) = self.a.take() {
            a.stop().await;
        }
        self.b.stop().await;
        assert!(
            late.is_empty(),
            "the job was delivered after its delete was applied ({} deliveries)",
            late.len()
        );
    }
}

/// Found by `tests/chaos.rs` (seed 10050776850473302011, 2026-12-01): a Redis request
/// that a bridge gave up on can still be applied after the commands that followed it.
/// A sends the put into a stalled Redis link, its response timeout fires, and it stops
/// with the batch unacked; B applies the redelivered put and then the delete. When the
/// link flows again, A's abandoned EVALSHA reaches Redis and stores the put again: the
/// deleted job is delivered. In a real network the same happens when a partition heals
/// while the sender's kernel still retransmits the request (also after the process
/// exited). Fixed by ingest fencing: B's session writes with a newer epoch, so A's late
/// request is refused (FENCED); it fails without it.
#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn an_abandoned_ingest_request_does_not_undo_a_later_delete() {
    bounded(FAULT_TEST_LIMIT, async {
        let mut case = Handover::start("stale").await;
        case.redis_proxy.hold();
        case.put_due_in_6s().await;
        // A takes the put; its EVALSHA waits in the stalled link; the 1 s timeout fires.
        tokio::time::sleep(1500 * Duration::from_millis(1)).await;
        if let Some(a) = case.a.take() {
            // Every stage and background task gives up its hung Redis call at shutdown
            // (CI, 2026-12-04: a requeue sweep kept A alive for 5 s, and the job fell due).
            let took = a.stop().await;
            assert!(
                took < 3 * SECOND,
                "A took {took:?} to stop with its Redis link hung"
            );
        }
        case.delete().await;
        case.assert_put_then_delete_applied().await;
        // A's abandoned request reaches Redis now.
        case.redis_proxy.restore();
        case.assert_nothing_delivered().await;
    });
}

/// Found by `tests/chaos.rs` (seed 4803213935284930482, 2026-12-01): ingest retried a
/// batch while Redis was unreachable even after its AMQP connection was gone and the
/// broker had given the batch to another bridge. A cannot reach Redis, then loses the
/// broker; B applies the put and the delete; when A reached Redis again, its retry stored
/// the put once more and the deleted job was delivered. Ingest now gives a batch up when
/// its channel closes. No stale bytes are involved: the Redis link is cut (connections
/// refused), not stalled.
#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn a_bridge_that_lost_its_batch_does_not_apply_it_later() {
    bounded(FAULT_TEST_LIMIT, async {
        let mut case = Handover::start("lostbatch").await;
        case.redis_proxy.cut();
        case.put_due_in_6s().await;
        tokio::time::sleep(1500 * Duration::from_millis(1)).await;
        // The broker takes the batch back from A and gives it to B.
        case.amqp_proxy.cut();
        case.delete().await;
        case.assert_put_then_delete_applied().await;
        // A's retry loop reaches Redis now.
        case.redis_proxy.restore();
        tokio::time::sleep(2 * SECOND).await;
        case.amqp_proxy.restore();
        case.assert_nothing_delivered().await;
    });
}

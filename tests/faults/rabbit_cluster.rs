//! RabbitMQ: the bridge against a 3-node RabbitMQ cluster losing a node.
//!
//! Three private nodes (`PrivateRabbit`, own ports, data and logs, one shared Erlang
//! cookie) on loopback; nodes 2 and 3 join node 1, so the quorum commands queue has three
//! replicas. The bridge gets the three URLs in `amqp.url` and, starting first, connects
//! both stages to node 1, which therefore also leads the commands queue. The producer
//! publishes through node 2 and the collector consumes the ready exchange through node 3
//! (its classic queue lives there). Mid-run node 1 is killed with SIGKILL: the bridge
//! must reconnect to a surviving node, the queue must elect a new leader, and every job
//! whose put was confirmed must still be delivered, none early, duplicates bounded.
//!
//! The shared RabbitMQ is never touched. Figures are printed
//! (`cargo test --test faults rabbit_cluster:: -- --nocapture`).

use crate::common;

use std::time::{Duration, Instant};

use common::bridge::*;
use common::faults::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

const SECOND: Duration = Duration::from_secs(1);

/// Starts three nodes in parallel and clusters them; returns them and how long it took.
fn start_cluster() -> (Vec<PrivateRabbit>, Duration) {
    let started = Instant::now();
    let cookie = format!("RSCLUSTER{}", now_ms());
    let spawned: Vec<_> = (0..3)
        .map(|_| {
            let cookie = cookie.clone();
            std::thread::spawn(move || PrivateRabbit::start_with_cookie(Some(&cookie)))
        })
        .collect();
    let nodes: Vec<PrivateRabbit> = spawned
        .into_iter()
        .map(|t| {
            t.join()
                .expect("node thread")
                .unwrap_or_else(|e| panic!("private RabbitMQ node: {e}"))
        })
        .collect();
    for node in &nodes {
        println!("[rcluster] node {} up in {:?}", node.node, node.started_in);
    }
    for node in &nodes[1..] {
        node.ctl_ok(&["stop_app"]);
        node.ctl_ok(&["reset"]);
        node.ctl_ok(&["join_cluster", &nodes[0].node]);
        node.ctl_ok(&["start_app"]);
        node.ctl_ok(&["await_startup"]);
    }
    let status = nodes[0].ctl(&["cluster_status"]).unwrap_or_else(|e| e);
    for node in &nodes {
        assert!(
            status.contains(&node.node),
            "{} not in the cluster:\n{status}",
            node.node
        );
    }
    (nodes, started.elapsed())
}

/// `name leader members` of the commands queue, as `rabbitmqctl list_queues` prints it.
fn queue_leader(node: &PrivateRabbit, queue: &str) -> String {
    let out = node
        .ctl(&["list_queues", "-q", "name", "leader", "members"])
        .unwrap_or_else(|e| e);
    out.lines()
        .find(|l| l.starts_with(queue))
        .unwrap_or("")
        .to_string()
}

/// The AMQP ports (which node) the bridge's connections are on, cluster-wide: the
/// connection name it sets is in the client properties.
fn bridge_connections(node: &PrivateRabbit) -> Vec<String> {
    let out = node
        .ctl(&["list_connections", "-q", "port", "client_properties"])
        .unwrap_or_else(|e| e);
    out.lines()
        .filter(|l| l.contains("redisched"))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn node_loss_in_a_three_node_cluster_loses_nothing() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let (nodes, took) = start_cluster();
        println!("[rcluster] 3-node cluster formed in {took:?}");
        let urls: Vec<String> = nodes.iter().map(|n| n.url()).collect();

        let mut config = test_config("rcluster");
        config.amqp.url = urls.join(",");
        config.dispatch.ttr_ms = 3_000;
        config.dispatch.window = 200;
        config.dispatch.batch = 100;
        config.ingest.prefetch = 200;
        config.ingest.batch = 100;
        config.amqp.heartbeat_secs = 2;
        let store = common::test_store_owning(&config.redis.prefix).await;

        // The bridge first: it declares the commands queue on node 1, which leads it.
        let bridge = InProcess::start(&config);
        let probe = connect_to(&urls[1]).await;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let deadline = Instant::now() + 30 * SECOND;
        loop {
            // A failed passive declare closes the channel: a new one each time.
            let ch = probe.create_channel().await.expect("channel");
            let consumers = ch
                .queue_declare(
                    config.amqp.commands_queue.as_str().into(),
                    passive,
                    FieldTable::default(),
                )
                .await
                .map(|q| q.consumer_count())
                .unwrap_or(0);
            if consumers > 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the bridge did not consume within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let queue = config.amqp.commands_queue.clone();
        let before = queue_leader(&nodes[1], &queue);
        println!("[rcluster] commands queue before: {before}");
        println!(
            "[rcluster] bridge connections before: {:?}",
            bridge_connections(&nodes[1])
        );

        let collector = Collector::start(&urls[2], &config).await;
        let stop = CancellationToken::new();
        let load = spawn_load(
            Producer::new(&urls[1], &config),
            10,
            3_000,
            Duration::from_millis(50),
            stop.clone(),
        );
        tokio::time::sleep(4 * SECOND).await;

        // SIGKILL node 1: the bridge's node and the queue's leader.
        let pid = nodes[0]
            .ctl(&["eval", "os:getpid()."])
            .expect("node 1 pid")
            .trim()
            .trim_matches('"')
            .to_string();
        let killed_at = now_ms();
        let status = std::process::Command::new("kill")
            .args(["-9", &pid])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -9 {pid}");
        println!("[rcluster] killed node 1 ({}, pid {pid})", nodes[0].node);

        let recovered = async {
            loop {
                if let Some(at) = collector.first_since(killed_at + 1) {
                    return at - killed_at;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let first = tokio::time::timeout(30 * SECOND, recovered).await.ok();
        tokio::time::sleep(8 * SECOND).await;
        stop.cancel();
        let ledger = {
            let mut producer = load.await.expect("load task");
            producer.close().await;
            let mut ledger = producer.ledger.lock().unwrap();
            std::mem::take(&mut *ledger)
        };
        let all = collector.wait_for_all(&ledger, 60 * SECOND).await;
        tokio::time::sleep(SECOND).await;
        let after = queue_leader(&nodes[1], &queue);
        let connections = bridge_connections(&nodes[1]);
        println!("[rcluster] commands queue after: {after}");
        println!("[rcluster] bridge connections after: {connections:?}");
        println!(
        "[rcluster] first delivery after the kill: {first:?} ms; deliveries after the kill: {}; all accepted delivered: {all}",
        collector.count_since(killed_at)
    );
        assert!(
            !bridge.handle.is_finished(),
            "the bridge stopped after the node loss"
        );
        bridge.stop().await;
        let seen = collector.stop().await;
        drop(store);

        let report = verify("rcluster", &ledger, &seen);
        // Both stages reconnected to a surviving node (by its AMQP port).
        let surviving: Vec<String> = nodes[1..].iter().map(|n| n.port.to_string()).collect();
        assert!(
        connections.len() >= 2
            && connections
                .iter()
                .all(|port| surviving.contains(port)),
        "the bridge is not connected (ingest and dispatch) to a surviving node: {connections:?}, survivors' ports {surviving:?}"
    );
        assert!(
            after.split_whitespace().nth(1) != Some(nodes[0].node.as_str()),
            "the commands queue still reports the killed node as leader: {after}"
        );
        assert!(first.is_some(), "no delivery within 30 s of the node loss");
        // One fault: a confirm window of published-but-unreleased jobs plus a prefetch of
        // applied-but-unacked commands.
        assert_promise(
            &report,
            config.dispatch.window + usize::from(config.ingest.prefetch),
            "",
        );
        let _ = tokio::time::timeout(5 * SECOND, probe.close(200, "bye".into())).await;
        // Node 1 is dead: its Drop only fails to reach it; the others stop normally.
        drop(nodes);
    });
}

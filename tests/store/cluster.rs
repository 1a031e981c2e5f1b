//! Redis Cluster: the scripts and the bridge on a private 3-primary, 3-replica cluster
//! started by the test, with topics spread over the slots by their hash tag, and a
//! primary killed under the bridge.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use common::bridge::*;
use common::cluster::Cluster;
use lapin::types::AMQPValue;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{ConnectOptions, Lease, Op, PutRequest, Store};

async fn cluster_store(cluster: &Cluster, prefix: &str) -> Store {
    let options = ConnectOptions {
        url: cluster.url(),
        prefix: prefix.into(),
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(5),
        tls_ca_file: None,
    };
    Store::connect(&options, common::DEFAULT_LIMITS)
        .await
        .expect("connect to the cluster")
}

fn put(topic: &Topic, id: String, due: Due) -> Op {
    Op::Put(PutRequest {
        topic: topic.clone(),
        id: JobId::new(id).unwrap(),
        body: b"body".to_vec(),
        meta: Vec::new(),
        due,
        mode: PutMode::Keep,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_script_works_with_topics_spread_over_the_cluster() {
    let cluster = Cluster::start(3);
    let store = cluster_store(&cluster, "rc").await;
    let topics: Vec<Topic> = (0..30)
        .map(|i| Topic::new(format!("topic-{i}")).unwrap())
        .collect();
    // One pipelined batch crossing every slot owner.
    let ops: Vec<Op> = topics
        .iter()
        .flat_map(|t| (0..4).map(move |j| put(t, format!("job-{j}"), Due::NOW)))
        .collect();
    let results = store.apply(&ops).await.expect("apply across slots");
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    assert_eq!(store.topics().await.unwrap().len(), 30);

    let mut released = 0;
    for topic in &topics {
        let batch = store
            .reserve(topic, Duration::from_secs(30), 10)
            .await
            .unwrap();
        assert_eq!(batch.jobs.len(), 4, "{topic}");
        let leases: Vec<Lease> = batch
            .jobs
            .iter()
            .map(|j| Lease {
                topic: topic.clone(),
                id: j.id.clone(),
                token: j.token,
            })
            .collect();
        released += store.release(&leases).await.unwrap();
        let stats = store.stats(topic).await.unwrap();
        assert_eq!((stats.scheduled, stats.reserved, stats.records), (0, 0, 0));
    }
    assert_eq!(released, 120);
    let heads = store.next_due_times(&topics).await.unwrap();
    assert!(heads.iter().all(Option::is_none));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_runs_on_a_cluster_and_rides_through_a_primary_failover() {
    let mut cluster = Cluster::start(3);
    let mut config = test_config("cluster");
    config.redis.url = cluster.url();
    config.redis.response_timeout_ms = 2_000;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);

    // Jobs on 20 topics (spread over the three primaries), due in 3 s.
    let n = 200;
    for i in 0..n {
        broker
            .put(
                &format!("c.{}", i % 20),
                &format!("job-{i}"),
                b"x",
                &[("x-delay", AMQPValue::LongInt(3_000))],
            )
            .await;
    }
    // Wait until the commands are applied and replicated, then kill a primary.
    let store = cluster_store(&cluster, &config.redis.prefix).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut total = 0;
        for t in store.topics().await.unwrap() {
            total += store.stats(&t).await.unwrap().scheduled;
        }
        if total == n as u64 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "only {total} of {n} applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for port in cluster.masters() {
        let _ = std::process::Command::new("redis-cli")
            .args(["-p", &port.to_string(), "WAIT", "1", "2000"])
            .output();
    }
    let victim = cluster.masters()[0];
    cluster.kill(victim);
    cluster.wait_healthy();

    let got = ready.collect(n, Duration::from_secs(60)).await;
    let ids: HashSet<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    assert_eq!(
        ids.len(),
        n,
        "every replicated job is delivered after the failover"
    );
    for (arrived, d) in &got {
        let due = header_i64(d, "x-redisched-due-at").unwrap();
        assert!(*arrived >= due, "never early");
    }
    bridge.stop().await;
    let _ = broker.connection.close(200, "bye".into()).await;
    // Exchanges and queues of this test (Redis keys die with the cluster).
    let cleanup = Broker::new(&config).await;
    cleanup.cleanup().await;
}

//! `redis.wait_replicas`: a command is acked (and an HTTP write answered) only once that
//! many replicas hold it, so a failover to a replica loses nothing that was acked. On a
//! private primary + replica (and a private cluster): a stalled replica holds the acks
//! back; a primary killed under load, its replica promoted, still has every acked
//! command; with the default 0 no `WAIT` is ever sent.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::cluster::Cluster;
use common::faults::{
    free_port, init_logging, queue_depth, spawn_bridge, tail, AmqpCleanup, PrivateRedis, Proxy,
    TempDir,
};
use lapin::types::{AMQPValue, ShortString};
use redisched::config::Config;
use redisched::job::{JobId, Topic};
use redisched::store::{ConnectOptions, KeySpace, Store};

const SECOND: Duration = Duration::from_secs(1);
/// Jobs of these tests are due in an hour: nothing is dispatched while they run.
const LATER_MS: i32 = 3_600_000;

/// A test configuration on the Redis at `redis_url`, waiting for `replicas`.
fn waiting_config(label: &str, redis_url: &str, replicas: u32) -> Config {
    let mut config = test_config(label);
    config.redis.url = redis_url.to_string();
    config.redis.wait_replicas = replicas;
    config.redis.wait_timeout_ms = 250;
    config.redis.response_timeout_ms = 2_000;
    config
}

async fn store_on(url: &str, prefix: &str) -> Store {
    let options = ConnectOptions {
        url: url.to_string(),
        prefix: prefix.to_string(),
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(5),
        tls_ca_file: None,
    };
    Store::connect(&options, common::DEFAULT_LIMITS)
        .await
        .unwrap_or_else(|err| panic!("cannot reach the private Redis at {url}: {err}"))
}

/// Messages ready in the commands queue (a passive declare). With the bridge stopped,
/// these are exactly the commands it never acked: shutdown leaves a held batch unacked.
/// The commands queue's ready count once it reads `expected` or 5 s have passed: a
/// quorum queue takes a stopped consumer's unacked messages back asynchronously, so a
/// count read straight after the stop can miss them.
async fn left_in_queue(broker: &Broker, expected: u32) -> u32 {
    let deadline = Instant::now() + 5 * SECOND;
    loop {
        let depth = queue_depth(&broker.channel, &broker.config.amqp.commands_queue)
            .await
            .expect("passive declare of the commands queue");
        if depth == expected || Instant::now() >= deadline {
            return depth;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `check` every 200 ms until it is true; fails with `what` after `within`.
async fn wait_until<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn scheduled(store: &Store, topic: &Topic) -> u64 {
    store.stats(topic).await.map(|s| s.scheduled).unwrap_or(0)
}

fn later() -> [(&'static str, AMQPValue); 1] {
    [("x-delay", AMQPValue::LongInt(LATER_MS))]
}

fn delete_op() -> [(&'static str, AMQPValue); 1] {
    [("x-redisched-op", text("delete"))]
}

/// Puts a bridge has applied and seen replicated (counted just before their ack), from
/// its `/metrics` at `base`.
async fn replicated_puts(base: &str) -> f64 {
    let Ok(response) = reqwest::get(format!("{base}/metrics")).await else {
        return 0.0;
    };
    let metrics = response.text().await.unwrap_or_default();
    ["scheduled", "duplicate"]
        .iter()
        .filter_map(|outcome| {
            sample(
                &metrics,
                &format!("redisched_commands_total{{op=\"put\",outcome=\"{outcome}\"}}"),
            )
        })
        .sum()
}

/// The value of an unlabelled sample (or a sample with the labels written in `name`).
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_replica_holds_acks_and_http_answers_until_it_catches_up() {
    init_logging();
    let primary = PrivateRedis::start();
    let replica = PrivateRedis::start_replica_of(primary.addr());
    let mut config = waiting_config("repl-hold", &primary.url(), 1);
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{}", free_port());
    let base = format!("http://{}", config.http.listen);
    let broker = Broker::new(&config).await;
    let _cleanup = AmqpCleanup {
        url: config.amqp.url.clone(),
        config: config.clone(),
    };
    let dir = TempDir::new("repl-hold");
    let log = dir.path().join("bridge.log");
    let mut bridge = spawn_bridge(&config, &log);
    let store = store_on(&primary.url(), &config.redis.prefix).await;
    let topic = Topic::new("hold").expect("topic");
    let http = reqwest::Client::new();
    let scrape = || async {
        match http.get(format!("{base}/metrics")).send().await {
            Ok(response) => response.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    };
    let counted = |metrics: &str, op: &str, outcome: &str| {
        sample(
            metrics,
            &format!("redisched_commands_total{{op=\"{op}\",outcome=\"{outcome}\"}}"),
        )
        .unwrap_or(0.0)
    };

    // Replica in step: commands are applied, replicated and acked as usual.
    for i in 0..5 {
        broker
            .put("hold", &format!("early-{i}"), b"early", &later())
            .await;
    }
    wait_until("5 puts applied and replicated", 30 * SECOND, || async {
        counted(&scrape().await, "put", "scheduled") == 5.0
    })
    .await;

    // Replica stalled: the first batch is applied on the primary but held, and the
    // commands behind it wait their turn (in order).
    replica.pause();
    for i in 0..10 {
        broker
            .put("hold", &format!("late-{i}"), b"late", &later())
            .await;
    }
    wait_until("a batch applied on the primary", 10 * SECOND, || async {
        scheduled(&store, &topic).await > 5
    })
    .await;
    // Six WAIT timeouts (without WAIT the batch would have been acked within ms).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let metrics = scrape().await;
    assert_eq!(
        counted(&metrics, "put", "scheduled"),
        5.0,
        "a held batch is neither counted nor acked"
    );
    let shortfalls = sample(
        &metrics,
        "redisched_replication_shortfalls_total{reason=\"timeout\"}",
    )
    .expect("shortfall counter");
    assert!(shortfalls >= 2.0, "{shortfalls} shortfalls:\n{metrics}");
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        logged.contains("command batch applied but not acked"),
        "no log line says why:\n{logged}"
    );
    // A job written over HTTP is not answered as accepted either.
    let refused = http
        .put(format!(
            "{base}/v1/topics/hold/jobs/http-1?delay_ms={LATER_MS}"
        ))
        .body("from http")
        .send()
        .await
        .expect("PUT");
    let status = refused.status();
    let body = refused.text().await.unwrap_or_default();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("0 of 1 replicas"), "{body}");
    // The replica catches up: the held batch and those behind it go through.
    replica.resume();
    wait_until("the 10 puts replicated", 20 * SECOND, || async {
        counted(&scrape().await, "put", "scheduled") == 15.0
    })
    .await;
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        logged.contains("replicas confirmed the held command batch"),
        "{logged}"
    );

    // Stalled again, two deletes held. The connection that wrote them dies: `WAIT` is
    // documented to cover the writes of its own connection only, so the batch is
    // applied again on the new one (counted as connection_replaced) and held as before.
    // (Redis 7.0.15 also makes a WAIT after any command cover all earlier writes of the
    // server, so here this part shows the path works; it could not catch a missing
    // identity check.)
    replica.pause();
    for i in 0..2 {
        broker
            .command("hold", props(&format!("early-{i}"), &delete_op()), b"")
            .await;
    }
    wait_until("a delete applied on the primary", 10 * SECOND, || async {
        scheduled(&store, &topic).await < 15
    })
    .await;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query(&mut primary.connection())
        .expect("CLIENT KILL");
    wait_until("the replaced connection noticed", 20 * SECOND, || async {
        sample(
            &scrape().await,
            "redisched_replication_shortfalls_total{reason=\"connection_replaced\"}",
        )
        .is_some_and(|n| n >= 1.0)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    // A shutdown while holding leaves the batch unacked: both deletes are back in the
    // queue.
    let (exit, _) = bridge.terminate();
    assert!(exit.success(), "{exit}");
    assert_eq!(
        left_in_queue(&broker, 2).await,
        2,
        "a delete was acked while the replica was stalled:\n{}",
        tail(&log, 30)
    );

    // A new bridge waits (its first ingest epoch is a write too) until the replica is
    // back; then everything is acked and on the replica.
    let mut bridge = spawn_bridge(&config, &log);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    replica.resume();
    wait_until(
        "the deletes applied and replicated",
        30 * SECOND,
        || async {
            counted(&scrape().await, "delete", "deleted")
                + counted(&scrape().await, "delete", "not_found")
                == 2.0
        },
    )
    .await;
    let accepted = http
        .put(format!(
            "{base}/v1/topics/hold/jobs/http-2?delay_ms={LATER_MS}"
        ))
        .body("from http")
        .send()
        .await
        .expect("PUT");
    assert_eq!(accepted.status(), 201);
    let (exit, _) = bridge.terminate();
    assert!(exit.success(), "{exit}");
    assert_eq!(left_in_queue(&broker, 0).await, 0, "every command acked");
    let jobs_key = KeySpace::new(config.redis.prefix.clone()).topic(&topic).0[2].clone();
    let ids: BTreeSet<String> = redis::cmd("HKEYS")
        .arg(&jobs_key)
        .query(&mut replica.connection())
        .expect("HKEYS on the replica");
    let mut expected: BTreeSet<String> = (2..5).map(|i| format!("early-{i}")).collect();
    expected.extend((0..10).map(|i| format!("late-{i}")));
    expected.extend(["http-1".to_string(), "http-2".to_string()]);
    assert_eq!(ids, expected);
    assert!(
        primary.info_field("commandstats", "cmdstat_wait").is_some(),
        "the bridge sent WAIT"
    );
    broker.cleanup().await;
}

/// One command the failover test publishes: put (`Some(body)`) or delete (`None`).
struct Sent {
    id: String,
    body: Option<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acked_command_survives_a_failover_to_the_replica() {
    init_logging();
    let mut primary = PrivateRedis::start();
    // Replication goes through a proxy that holds it back in bursts (a lagging replica),
    // and is cut when the primary dies: what it held is lost, as on a real failover.
    let link = Arc::new(Proxy::start(primary.addr()).await);
    let replica = PrivateRedis::start_replica_of(link.addr);
    let mut config = waiting_config("repl-failover", &primary.url(), 1);
    config.ingest.batch = 20;
    let queue = config.amqp.commands_queue.clone();
    let broker = Broker::new(&config).await;
    let _cleanup = AmqpCleanup {
        url: config.amqp.url.clone(),
        config: config.clone(),
    };
    let bridge = InProcess::start(&config);

    // 400 commands at ~150/s on one topic: puts, and every 4th a delete of the put two
    // before it.
    let commands: Arc<Vec<Sent>> = Arc::new(
        (0..400)
            .map(|i| {
                if i % 4 == 3 {
                    Sent {
                        id: format!("job-{}", i - 2),
                        body: None,
                    }
                } else {
                    Sent {
                        id: format!("job-{i}"),
                        body: Some(format!("body-{i}")),
                    }
                }
            })
            .collect(),
    );
    let lagging = Arc::new(AtomicBool::new(true));
    let lag = {
        let (lagging, link) = (lagging.clone(), link.clone());
        tokio::spawn(async move {
            while lagging.load(Ordering::Relaxed) {
                link.hold();
                tokio::time::sleep(Duration::from_millis(150)).await;
                link.restore();
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
        })
    };
    let published = Arc::new(AtomicUsize::new(0));
    let producer = {
        let (commands, published) = (commands.clone(), published.clone());
        let producer = Broker::new(&config).await;
        tokio::spawn(async move {
            for (index, command) in commands.iter().enumerate() {
                let headers = match command.body {
                    Some(_) => later().to_vec(),
                    None => delete_op().to_vec(),
                };
                let props = props(&command.id, &headers)
                    .with_correlation_id(ShortString::from(index.to_string()));
                let body = command.body.clone().unwrap_or_default();
                producer.command("f", props, body.as_bytes()).await;
                published.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = producer.connection.close(200, "bye".into()).await;
        })
    };

    // Kill the primary in the middle of the stream, while acks are going out.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    primary.kill9();
    link.cut();
    lagging.store(false, Ordering::Relaxed);
    let _ = lag.await;
    replica.promote();
    producer.await.expect("producer");
    bridge.stop().await;

    // What the broker still holds was never acked; everything else was.
    let mut left = broker.consume_queue(&queue).await;
    let unacked: BTreeSet<usize> = left
        .drain(2 * SECOND)
        .await
        .iter()
        .map(|(_, d)| {
            d.properties
                .correlation_id()
                .as_ref()
                .expect("correlation id")
                .as_str()
                .parse::<usize>()
                .expect("index")
        })
        .collect();
    let total = published.load(Ordering::Relaxed);
    assert_eq!(total, commands.len());
    let acked = total - unacked.len();
    assert_eq!(
        unacked,
        (acked..total).collect::<BTreeSet<usize>>(),
        "acks are cumulative: what is left must be the tail of the stream"
    );
    assert!(
        acked > 20 && acked < total,
        "the kill must fall inside the stream: {acked} of {total} acked"
    );

    // The promoted replica holds the state of every acked command, applied in order. A
    // command not acked may have been applied and replicated too (the primary died
    // between its WAIT and the ack, or its batch waited behind an earlier one that never
    // heard from the replica): ingest promises ack after apply, not the converse, and the
    // broker redelivers it. So each job may be as the acked commands left it, or as a
    // later command on it left it, in order.
    let mut allowed: BTreeMap<&str, Vec<(usize, Option<&str>)>> = BTreeMap::new();
    for command in &commands[..acked] {
        allowed.insert(&command.id, vec![(acked, command.body.as_deref())]);
    }
    for (index, command) in commands.iter().enumerate().skip(acked) {
        if let Some(states) = allowed.get_mut(command.id.as_str()) {
            states.push((index, command.body.as_deref()));
        }
    }
    eprintln!("failover: {acked} of {total} commands acked before the kill");
    let store = store_on(&replica.url(), &config.redis.prefix).await;
    let topic = Topic::new("f").expect("topic");
    let mut wrong = Vec::new();
    for (id, states) in &allowed {
        let job = store
            .get(&topic, &JobId::new(*id).expect("id"))
            .await
            .expect("get");
        let found = job
            .as_ref()
            .map(|j| String::from_utf8_lossy(&j.body).into_owned());
        match states.iter().find(|(_, body)| found.as_deref() == *body) {
            Some((index, _)) if *index >= acked && states[0].1 != found.as_deref() => {
                eprintln!("failover: {id} as command {index} left it, applied but not acked");
            }
            Some(_) => {}
            None => wrong.push(format!("{id}: want one of {states:?}, found {found:?}")),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} job ids differ from what the {acked} acked commands (and those after them) left:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    let _ = broker.connection.close(200, "bye".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_wait_replicas_no_wait_is_sent() {
    init_logging();
    let primary = PrivateRedis::start();
    let _replica = PrivateRedis::start_replica_of(primary.addr());
    let config = waiting_config("repl-none", &primary.url(), 0);
    let broker = Broker::new(&config).await;
    let _cleanup = AmqpCleanup {
        url: config.amqp.url.clone(),
        config: config.clone(),
    };
    let bridge = InProcess::start(&config);
    let store = store_on(&primary.url(), &config.redis.prefix).await;
    let topic = Topic::new("plain").expect("topic");
    for i in 0..5 {
        broker.put("plain", &format!("p-{i}"), b"x", &later()).await;
    }
    wait_until("5 puts applied", 30 * SECOND, || async {
        scheduled(&store, &topic).await == 5
    })
    .await;
    bridge.stop().await;
    assert_eq!(left_in_queue(&broker, 0).await, 0, "every command acked");
    assert!(
        primary
            .info_field("commandstats", "cmdstat_evalsha")
            .is_some(),
        "the bridge wrote through this Redis"
    );
    for command in ["cmdstat_wait", "cmdstat_client|info"] {
        assert_eq!(
            primary.info_field("commandstats", command),
            None,
            "{command} with redis.wait_replicas = 0"
        );
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_each_written_primary_waits_for_its_own_replica() {
    init_logging();
    let mut cluster = Cluster::start(3);
    let mut config = waiting_config("repl-cluster", &cluster.url(), 1);
    config.redis.wait_timeout_ms = 300;
    // The cluster client connects to the stalled replica too; it must give up quickly.
    config.redis.connect_timeout_ms = 1_000;
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{}", free_port());
    let base = format!("http://{}", config.http.listen);
    let keys = KeySpace::new(config.redis.prefix.clone());
    // `stalled`: a topic on a primary that holds neither the topic set (every put batch
    // writes there too) nor the ingest epoch counter (every session start writes it);
    // `free`: a topic on another primary.
    let shared_owners = [
        cluster.primary_of(&keys.topics()),
        cluster.primary_of(&keys.ingest_epoch()),
    ];
    let owner = |name: &str| {
        let topic = Topic::new(name).expect("topic");
        cluster.primary_of(&keys.topic(&topic).0[0])
    };
    let names: Vec<String> = (0..64).map(|i| format!("t{i}")).collect();
    let stalled = names
        .iter()
        .find(|n| !shared_owners.contains(&owner(n)))
        .expect("a topic off the primaries of the shared keys")
        .clone();
    let stalled_primary = owner(&stalled);
    let free = names
        .iter()
        .find(|n| owner(n) != stalled_primary)
        .expect("a topic on another primary")
        .clone();
    let stalled_replica = cluster.replica_of(stalled_primary);

    let broker = Broker::new(&config).await;
    let _cleanup = AmqpCleanup {
        url: config.amqp.url.clone(),
        config: config.clone(),
    };
    let store = store_on(&cluster.url(), &config.redis.prefix).await;
    let (stalled_topic, free_topic) = (
        Topic::new(stalled.clone()).expect("topic"),
        Topic::new(free.clone()).expect("topic"),
    );

    // One primary's replica stalled: batches that write elsewhere are still acked.
    cluster.pause(stalled_replica);
    let bridge = InProcess::start(&config);
    for i in 0..5 {
        broker
            .put(&free, &format!("free-{i}"), b"free", &later())
            .await;
    }
    wait_until("5 puts applied and replicated", 30 * SECOND, || async {
        replicated_puts(&base).await == 5.0
    })
    .await;
    bridge.stop().await;
    assert_eq!(
        left_in_queue(&broker, 0).await,
        0,
        "commands for primaries with a live replica are acked"
    );

    // A command for the stalled primary is applied but held, and all behind it waits.
    let bridge = InProcess::start(&config);
    for i in 0..5 {
        broker
            .put(&stalled, &format!("held-{i}"), b"held", &later())
            .await;
    }
    for i in 5..10 {
        broker
            .put(&free, &format!("free-{i}"), b"free", &later())
            .await;
    }
    wait_until(
        "a batch applied on the stalled primary",
        10 * SECOND,
        || async { scheduled(&store, &stalled_topic).await > 0 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    bridge.stop().await;
    assert_eq!(
        left_in_queue(&broker, 10).await,
        10,
        "a write to the primary with the stalled replica was acked"
    );

    // The replica resumes: everything is acked; the primary dies, its replica takes
    // over, and every acked command is there.
    let bridge = InProcess::start(&config);
    cluster.resume(stalled_replica);
    wait_until(
        "every command applied and replicated",
        30 * SECOND,
        || async { replicated_puts(&base).await == 10.0 },
    )
    .await;
    bridge.stop().await;
    assert_eq!(left_in_queue(&broker, 0).await, 0, "every command acked");
    cluster.kill(stalled_primary);
    let deadline = Instant::now() + 30 * SECOND;
    while cluster.masters().len() < 3 || !cluster.masters().contains(&stalled_replica) {
        assert!(Instant::now() < deadline, "no failover within 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.wait_healthy();
    // A client that learns the new slot map (the old one still names the dead primary).
    let store = store_on(&cluster.url(), &config.redis.prefix).await;
    for (topic, prefix, count) in [(&stalled_topic, "held", 5), (&free_topic, "free", 10)] {
        for i in 0..count {
            let id = JobId::new(format!("{prefix}-{i}")).expect("id");
            let job = loop {
                match store.get(topic, &id).await {
                    Err(err) if err.is_unavailable() && Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    other => break other.expect("get after failover"),
                }
            };
            assert_eq!(
                job.map(|j| j.body),
                Some(prefix.as_bytes().to_vec()),
                "{topic}/{id} after the failover"
            );
        }
    }
    let _ = broker.connection.close(200, "bye".into()).await;
}

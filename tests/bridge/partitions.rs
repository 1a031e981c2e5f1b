//! Partitioned commands (`amqp.command_partitions` > 1): real bridges as child
//! processes on the real broker, each test under its own names. A job's commands hash
//! (on `message_id`) to one partition, so however the partitions move between bridges
//! (several at once, one SIGKILLed, one added and one removed, the topology switched
//! from one commands queue to partitions) each job ends as its last command says.

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::bridge::{text, Broker, ChildBridge};
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use redisched::config::Config;

const PARTITIONS: u16 = 8;

fn config(label: &str, partitions: u16) -> Config {
    let mut config = common::bridge::test_config(label);
    config.amqp.command_partitions = partitions;
    config.ingest.batch = 16;
    config
}

fn delay(ms: i64) -> (&'static str, AMQPValue) {
    ("x-delay", AMQPValue::LongLongInt(ms))
}

fn op(name: &str) -> (&'static str, AMQPValue) {
    ("x-redisched-op", text(name))
}

/// Ready messages and consumers of `queue`, `None` if it does not exist.
async fn queue_state(broker: &Broker, queue: &str) -> Option<(u32, u32)> {
    let channel = broker.connection.create_channel().await.expect("channel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let state = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .ok()
        .map(|ok| (ok.message_count(), ok.consumer_count()));
    let _ = channel.close(200, "probed".into()).await;
    state
}

/// A bridge of this build whose log goes to a file, so a test can see that it
/// consumes (a waiting single-active consumer is invisible to a passive declare).
struct Logged {
    bridge: ChildBridge,
    log: std::path::PathBuf,
}

impl Logged {
    fn start(config: &Config) -> Self {
        let log = std::env::temp_dir().join(format!("{}.log", common::unique("partlog")));
        let file = std::fs::File::create(&log).expect("log file");
        let stderr = file.try_clone().expect("log file");
        let bridge = ChildBridge::start_logging(config, file.into(), stderr.into());
        Self { bridge, log }
    }

    /// Waits until the bridge consumes `queues` queues (active or waiting on each).
    async fn await_consuming(&self, queues: usize, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if text.matches("consuming commands").count() >= queues {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the bridge did not consume {queues} queues within {within:?}; its log:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the bridge's log contains `needle`.
    async fn await_log(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log_text().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "the bridge did not log {needle:?} within {within:?}; its log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        // A failing test shows what the bridge said (its log file goes with it).
        if std::thread::panicking() {
            eprintln!(
                "--- bridge log {}:\n{}",
                self.log.display(),
                self.log_text()
            );
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

impl std::ops::Deref for Logged {
    type Target = ChildBridge;
    fn deref(&self) -> &ChildBridge {
        &self.bridge
    }
}

impl std::ops::DerefMut for Logged {
    fn deref_mut(&mut self) -> &mut ChildBridge {
        &mut self.bridge
    }
}

/// Starts `count` bridges and waits until each consumes every partition.
async fn start_bridges(config: &Config, count: usize) -> Vec<Logged> {
    let bridges: Vec<Logged> = (0..count).map(|_| Logged::start(config)).collect();
    for bridge in &bridges {
        bridge
            .await_consuming(
                usize::from(config.amqp.command_partitions),
                Duration::from_secs(60),
            )
            .await;
    }
    bridges
}

/// `count` bridges, each consuming, once every one has seen the partitions shared out
/// among all `count`.
async fn start_shared_bridges(config: &Config, count: usize) -> Vec<Logged> {
    let bridges = start_bridges(config, count).await;
    let shared = format!("command partitions shared out anew bridges={count}");
    for bridge in &bridges {
        bridge.await_log(&shared, Duration::from_secs(30)).await;
    }
    bridges
}

/// The jobs of one run: for each id, `put a` and `replace b` (both far in the
/// future), then either `replace final-<i>` due soon (even ids) or `delete` (odd
/// ids). The three commands of an id are published in three rounds over a chunk of
/// ids, so they travel in different batches, with other ids' commands between them.
struct Sequences {
    topic: String,
    ids: Vec<String>,
}

impl Sequences {
    fn new(label: &str, count: usize) -> Self {
        Self {
            topic: format!("{label}-topic"),
            ids: (0..count).map(|i| format!("{label}-job-{i}")).collect(),
        }
    }

    /// Publishes the chunk `range` of ids (three rounds).
    async fn publish(&self, broker: &Broker, range: std::ops::Range<usize>) {
        let far = 3_600_000;
        for i in range.clone() {
            broker
                .put(&self.topic, &self.ids[i], b"a", &[delay(far)])
                .await;
        }
        for i in range.clone() {
            broker
                .put(
                    &self.topic,
                    &self.ids[i],
                    b"b",
                    &[delay(far), op("replace")],
                )
                .await;
        }
        for i in range {
            if i % 2 == 0 {
                let body = format!("final-{i}");
                broker
                    .put(
                        &self.topic,
                        &self.ids[i],
                        body.as_bytes(),
                        &[delay(300), op("replace")],
                    )
                    .await;
            } else {
                broker
                    .put(&self.topic, &self.ids[i], b"", &[op("delete")])
                    .await;
            }
        }
    }

    /// Collects deliveries and checks the outcome of every id: each even id delivered
    /// with its final body (never `a` or `b`), no odd id delivered, nothing set aside.
    async fn verify(
        &self,
        ready: &mut common::bridge::Receiver,
        invalid: &mut common::bridge::Receiver,
        within: Duration,
    ) {
        let expected = self.ids.len().div_ceil(2);
        let deadline = Instant::now() + within;
        let mut bodies: HashMap<String, Vec<String>> = HashMap::new();
        while bodies.len() < expected && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some((_, delivery)) = ready.next(left).await else {
                break;
            };
            let id = common::bridge::message_id(&delivery);
            let body = String::from_utf8_lossy(&delivery.data).into_owned();
            bodies.entry(id).or_default().push(body);
        }
        // Anything late (an odd id that should not come at all) has a chance to show.
        for (_, delivery) in ready.drain(Duration::from_millis(1_500)).await {
            let id = common::bridge::message_id(&delivery);
            let body = String::from_utf8_lossy(&delivery.data).into_owned();
            bodies.entry(id).or_default().push(body);
        }
        let mut wrong = Vec::new();
        let mut missing = Vec::new();
        for (i, id) in self.ids.iter().enumerate() {
            let got = bodies.get(id);
            if i % 2 == 0 {
                let want = format!("final-{i}");
                match got {
                    None => missing.push(id.clone()),
                    Some(list) if list.iter().any(|b| *b != want) => {
                        wrong.push(format!("{id}: {list:?}"))
                    }
                    Some(_) => {}
                }
            } else if let Some(list) = got {
                wrong.push(format!("{id} (deleted): {list:?}"));
            }
        }
        assert!(
            missing.is_empty(),
            "{} of {expected} jobs never delivered, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        );
        assert!(
            wrong.is_empty(),
            "{} jobs out of order, e.g. {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
        let set_aside = invalid.drain(Duration::from_millis(200)).await;
        assert!(
            set_aside.is_empty(),
            "{} commands set aside",
            set_aside.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_bridges_over_eight_partitions_apply_each_jobs_commands_in_order() {
    let _shared = common::timed::shared().await;
    let config = config("part3", PARTITIONS);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    // The partitions are shared out among the three (each bridge announces itself in
    // Redis; a partition held by a bridge it is not shared out to is handed over).
    let mut bridges = start_shared_bridges(&config, 3).await;

    let jobs = Sequences::new("p3", 600);
    for chunk in 0..6 {
        jobs.publish(&broker, chunk * 100..(chunk + 1) * 100).await;
    }
    jobs.verify(&mut ready, &mut invalid, Duration::from_secs(60))
        .await;
    for k in 0..PARTITIONS {
        let queue = redisched::amqp::partition_queue(&config.amqp, k);
        let (depth, _) = queue_state(&broker, &queue)
            .await
            .expect("partition exists");
        assert_eq!(depth, 0, "{queue} still holds commands");
    }
    // The commands were applied by more than one bridge: the partitions spread.
    let active: Vec<usize> = bridges
        .iter()
        .map(|b| {
            b.log_text()
                .matches("active consumer of this command partition")
                .count()
        })
        .collect();
    eprintln!("partitions each bridge became the active consumer of: {active:?}");
    assert!(
        active.iter().filter(|n| **n > 0).count() >= 2,
        "one bridge applied every partition: {active:?}"
    );
    for bridge in &mut bridges {
        bridge.terminate();
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_killed_while_holding_partitions_loses_and_reorders_nothing() {
    let _shared = common::timed::shared().await;
    let config = config("partkill", PARTITIONS);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let mut bridges = start_shared_bridges(&config, 3).await;

    let jobs = Sequences::new("pk", 600);
    jobs.publish(&broker, 0..200).await;
    // The bridge holding the most partitions now (taken minus handed over).
    let held = |b: &Logged| {
        let text = b.log_text();
        text.matches("active consumer of this command partition")
            .count()
            .saturating_sub(text.matches("handing this command partition over").count())
    };
    let victim = (0..bridges.len())
        .max_by_key(|i| held(&bridges[*i]))
        .unwrap_or(0);
    assert!(held(&bridges[victim]) > 0, "no bridge holds a partition");
    let mut first = bridges.remove(victim);
    let mut others = bridges;
    // SIGKILL while it holds its partitions with commands in flight: its unacked
    // batches go back and are applied again, in order, by the next bridge.
    let publishing = jobs.publish(&broker, 200..400);
    let kill = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        first.kill9();
    };
    tokio::join!(publishing, kill);
    jobs.publish(&broker, 400..600).await;
    jobs.verify(&mut ready, &mut invalid, Duration::from_secs(90))
        .await;
    for bridge in &mut others {
        bridge.terminate();
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_added_and_one_removed_while_commands_flow_keep_each_jobs_order() {
    let _shared = common::timed::shared().await;
    let config = config("partmove", PARTITIONS);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let mut first = start_bridges(&config, 1).await.remove(0);

    let jobs = Sequences::new("pm", 600);
    jobs.publish(&broker, 0..150).await;
    // Added while commands flow: it waits on every partition ...
    let second = Logged::start(&config);
    jobs.publish(&broker, 150..300).await;
    second
        .await_consuming(usize::from(PARTITIONS), Duration::from_secs(60))
        .await;
    let mut second = second;
    // ... and takes them over when the first one leaves (SIGTERM) mid-flow.
    let publishing = jobs.publish(&broker, 300..450);
    let leave = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, _) = first.terminate();
        assert!(status.success(), "the first bridge exited with {status}");
    };
    tokio::join!(publishing, leave);
    jobs.publish(&broker, 450..600).await;
    jobs.verify(&mut ready, &mut invalid, Duration::from_secs(90))
        .await;
    second.terminate();
    broker.cleanup().await;
}

/// 1 → N while commands flow: a bridge configured with one commands queue consumes it;
/// a bridge configured with 8 partitions starts, unbinds the old queue (new commands
/// go to the partitions) and waits, without consuming the partitions, while the old
/// bridge still consumes the old queue; once the old bridge is gone it applies what the
/// old queue still holds, deletes it, and only then consumes the partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_one_queue_to_partitions_drains_the_old_queue_first() {
    let _shared = common::timed::shared().await;
    let single = config("partswitch", 1);
    let mut partitioned = single.clone();
    partitioned.amqp.command_partitions = PARTITIONS;
    let broker = Broker::new(&single).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let jobs = Sequences::new("ps", 600);

    // Old topology, no bridge yet: the first 200 ids' commands wait in the one queue.
    jobs.publish(&broker, 0..200).await;
    let (held, _) = queue_state(&broker, &single.amqp.commands_queue)
        .await
        .expect("the commands queue exists");
    assert_eq!(held, 600, "the old queue holds the first commands");

    let mut old = ChildBridge::start(&single);
    let deadline = Instant::now() + Duration::from_secs(60);
    while queue_state(&broker, &single.amqp.commands_queue)
        .await
        .map_or(0, |s| s.1)
        == 0
    {
        assert!(Instant::now() < deadline, "the old bridge did not consume");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut new = Logged::start(&partitioned);
    // The new bridge unbinds the old queue: from then on commands go to the partitions.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let k0 = redisched::amqp::partition_queue(&single.amqp, 0);
        if queue_state(&broker, &k0).await.is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the partitions were not declared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    jobs.publish(&broker, 200..400).await;
    // While the old bridge consumes the old queue, the new one waits: nothing of the
    // route queue or the partitions is consumed.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let route = redisched::amqp::route_queue(&single.amqp);
    let (mut waiting, routers) = queue_state(&broker, &route).await.expect("route queue");
    assert_eq!(
        routers,
        0,
        "{route} consumed before the old queue was drained; the new bridge's log:\n{}",
        new.log_text()
    );
    for k in 0..PARTITIONS {
        let queue = redisched::amqp::partition_queue(&single.amqp, k);
        let (depth, consumers) = queue_state(&broker, &queue).await.expect("partition");
        assert_eq!(
            consumers,
            0,
            "{queue} consumed before the old queue was drained; the new bridge's log:\n{}",
            new.log_text()
        );
        waiting += depth;
    }
    assert!(
        waiting > 0,
        "the commands published after the switch are not in the route queue or the partitions"
    );
    // The old bridge leaves while commands flow; the new one drains and switches.
    let publishing = jobs.publish(&broker, 400..500);
    let leave = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        old.terminate();
    };
    tokio::join!(publishing, leave);
    jobs.publish(&broker, 500..600).await;
    jobs.verify(&mut ready, &mut invalid, Duration::from_secs(90))
        .await;
    assert!(
        queue_state(&broker, &single.amqp.commands_queue)
            .await
            .is_none(),
        "the old commands queue was not deleted after it drained"
    );
    new.terminate();
    broker.cleanup().await;
}

/// N → 1: the reverse switch, with the partitions holding commands and no bridge up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_partitions_to_one_queue_drains_the_partitions_first() {
    let _shared = common::timed::shared().await;
    let partitioned = config("partback", PARTITIONS);
    let mut single = partitioned.clone();
    single.amqp.command_partitions = 1;
    let broker = Broker::new(&partitioned).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let jobs = Sequences::new("pb", 400);
    // A partitioned bridge ran (its ingest records the partition count in Redis) ...
    let mut before = start_bridges(&partitioned, 1).await;
    before.remove(0).terminate();
    // ... and left commands in the partitions when it stopped.
    jobs.publish(&broker, 0..200).await;
    let mut bridge = Logged::start(&single);
    jobs.publish(&broker, 200..400).await;
    jobs.verify(&mut ready, &mut invalid, Duration::from_secs(90))
        .await;
    for k in 0..PARTITIONS {
        let queue = redisched::amqp::partition_queue(&single.amqp, k);
        assert!(
            queue_state(&broker, &queue).await.is_none(),
            "{queue} was not deleted after it drained"
        );
    }
    bridge.terminate();
    broker.cleanup().await;
}

/// Depth of every partition queue.
async fn partition_depths(broker: &Broker, config: &Config) -> Vec<u32> {
    let mut depths = Vec::new();
    for k in 0..config.amqp.command_partitions {
        let queue = redisched::amqp::partition_queue(&config.amqp, k);
        depths.push(queue_state(broker, &queue).await.expect("partition").0);
    }
    depths
}

/// A producer that sets only `x-redisched-id` (no `message_id`): the router partitions
/// by that header like by `message_id`, so such commands spread over the partitions as
/// well, each id's in publish order, and are applied in order; none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_without_message_id_are_partitioned_by_their_id_header_and_applied_in_order() {
    let _shared = common::timed::shared().await;
    let config = config("partnoid", PARTITIONS);
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let topic = "noid-topic";
    let header_only = |id: &str, headers: &[(&str, AMQPValue)]| {
        let mut table = FieldTable::default();
        table.insert("x-redisched-id".into(), text(id));
        for (k, v) in headers {
            table.insert((*k).into(), v.clone());
        }
        BasicProperties::default().with_headers(table)
    };
    let ids: Vec<String> = (0..20).map(|i| format!("noid-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        broker
            .command(topic, header_only(id, &[delay(3_600_000)]), b"a")
            .await;
        let last = if i % 2 == 0 {
            header_only(id, &[delay(300), op("replace")])
        } else {
            header_only(id, &[op("delete")])
        };
        broker.command(topic, last, id.as_bytes()).await;
    }
    // Before any bridge: all 40 commands wait in the route queue.
    let route = redisched::amqp::route_queue(&config.amqp);
    assert_eq!(queue_state(&broker, &route).await.map(|s| s.0), Some(40));
    common::route::route_everything(&broker.connection, &config.amqp).await;
    let mut expected = vec![0u32; usize::from(PARTITIONS)];
    for id in &ids {
        expected[usize::from(redisched::amqp::partition_of(id.as_bytes(), PARTITIONS))] += 2;
    }
    let depths = partition_depths(&broker, &config).await;
    assert_eq!(
        depths, expected,
        "each id's two commands in the partition of its id"
    );
    assert!(
        depths.iter().filter(|d| **d > 0).count() >= 4,
        "20 ids routed onto fewer than 4 partitions: {depths:?}"
    );

    let mut bridge = ChildBridge::start(&config);
    let mut got: HashMap<String, String> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while got.len() < 10 && Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some((_, delivery)) = ready.next(left).await else {
            break;
        };
        let id = common::bridge::header_text(&delivery, "x-redisched-id")
            .unwrap_or_else(|| common::bridge::message_id(&delivery));
        got.insert(id, String::from_utf8_lossy(&delivery.data).into_owned());
    }
    for (_, delivery) in ready.drain(Duration::from_millis(1_500)).await {
        let id = common::bridge::message_id(&delivery);
        got.insert(id, String::from_utf8_lossy(&delivery.data).into_owned());
    }
    for (i, id) in ids.iter().enumerate() {
        if i % 2 == 0 {
            assert_eq!(
                got.get(id),
                Some(id),
                "{id} not delivered with its last body"
            );
        } else {
            assert!(!got.contains_key(id), "{id} delivered after its delete");
        }
    }
    assert_eq!(got.len(), 10, "unexpected deliveries: {got:?}");
    assert!(invalid.drain(Duration::from_millis(200)).await.is_empty());
    bridge.terminate();
    broker.cleanup().await;
}

/// A deployment partitioned by the release before (through the consistent-hash
/// exchange, its record a bare count): a partitioned bridge of this release refuses it
/// and says how to go on; a bridge with one queue drains the old partitions and
/// switches, after which the partitioned bridge consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_befores_hashed_partitions_are_refused_until_switched_through_one_queue() {
    let _shared = common::timed::shared().await;
    let partitioned = config("parthashed", PARTITIONS);
    let mut single = partitioned.clone();
    single.amqp.command_partitions = 1;
    let broker = Broker::new(&single).await;
    let record = format!("{}:command-partitions", partitioned.redis.prefix);
    let mut redis = redis::Client::open(common::redis_url())
        .and_then(|c| c.get_connection())
        .expect("redis");
    let () = redis::cmd("SET")
        .arg(&record)
        .arg(PARTITIONS)
        .query(&mut redis)
        .expect("SET the release before's record");

    let mut refusing = Logged::start(&partitioned);
    refusing
        .await_log("by the release before", Duration::from_secs(60))
        .await;
    refusing.terminate();
    let mut switching = Logged::start(&single);
    switching.await_consuming(1, Duration::from_secs(60)).await;
    let left: Option<String> = redis::cmd("GET")
        .arg(&record)
        .query(&mut redis)
        .expect("GET");
    assert_eq!(left, None, "the one-queue bridge did not switch the record");
    switching.terminate();
    let mut routed = Logged::start(&partitioned);
    routed
        .await_consuming(usize::from(PARTITIONS), Duration::from_secs(60))
        .await;
    let now: Option<String> = redis::cmd("GET")
        .arg(&record)
        .query(&mut redis)
        .expect("GET");
    assert_eq!(now.as_deref(), Some("routed:8"));
    routed.terminate();
    broker.cleanup().await;
}

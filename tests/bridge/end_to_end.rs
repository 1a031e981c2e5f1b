//! End-to-end: commands published to RabbitMQ, jobs consumed from the ready exchange,
//! with a real bridge in between (the wire contract of README "Wire contract").

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use common::bridge::*;
use lapin::types::{AMQPValue, ByteArray, FieldArray, FieldTable};
use lapin::BasicProperties;

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_arrive_on_time_never_early_with_body_and_headers_intact() {
    let _shared = common::timed::shared().await;
    let config = test_config("ontime");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);

    let mut nested = FieldTable::default();
    nested.insert("k".into(), AMQPValue::LongLongInt(-5));
    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongInt(400));
    headers.insert("custom-int".into(), AMQPValue::ShortInt(-12));
    headers.insert("custom-bool".into(), AMQPValue::Boolean(true));
    headers.insert("custom-table".into(), AMQPValue::FieldTable(nested.clone()));
    headers.insert(
        "custom-array".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongString("a".into()),
            AMQPValue::Boolean(false),
        ])),
    );
    headers.insert(
        "custom-bytes".into(),
        AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1, 255])),
    );
    let props = BasicProperties::default()
        .with_message_id("welcome-42".into())
        .with_content_type("application/octet-stream".into())
        .with_content_encoding("identity".into())
        .with_type("welcome".into())
        .with_app_id("signup".into())
        .with_correlation_id("corr-1".into())
        .with_priority(4)
        .with_timestamp(1_700_000_000)
        .with_expiration("60000".into())
        .with_headers(headers);
    let body: &[u8] = b"\x00binary\xff\xfe body\n";
    let sent_at = now_ms();
    broker.command("mail.welcome", props, body).await;

    let (arrived, job) = ready.next(10 * SECOND).await.expect("job delivered");
    let due = header_i64(&job, "x-redisched-due-at").expect("due-at header");
    assert!(due >= sent_at + 400 - 5, "due {due} vs sent {sent_at}");
    assert!(arrived >= due, "delivered {} ms early", due - arrived);
    assert!(arrived - due < 1_000, "delivered {} ms late", arrived - due);
    assert_eq!(job.data, body);
    assert_eq!(job.routing_key.as_str(), "mail.welcome");
    assert_eq!(message_id(&job), "welcome-42");
    let p = &job.properties;
    assert_eq!(
        p.content_type().as_ref().map(|s| s.as_str()),
        Some("application/octet-stream")
    );
    assert_eq!(
        p.content_encoding().as_ref().map(|s| s.as_str()),
        Some("identity")
    );
    assert_eq!(p.kind().as_ref().map(|s| s.as_str()), Some("welcome"));
    assert_eq!(p.app_id().as_ref().map(|s| s.as_str()), Some("signup"));
    assert_eq!(
        p.correlation_id().as_ref().map(|s| s.as_str()),
        Some("corr-1")
    );
    assert_eq!(p.priority(), &Some(4));
    assert_eq!(p.timestamp(), &Some(1_700_000_000));
    assert_eq!(p.delivery_mode(), &Some(2), "persistent");
    assert_eq!(p.expiration(), &None, "expiration is not copied");
    assert_eq!(header(&job, "custom-int"), Some(&AMQPValue::ShortInt(-12)));
    assert_eq!(header(&job, "custom-bool"), Some(&AMQPValue::Boolean(true)));
    assert_eq!(
        header(&job, "custom-table"),
        Some(&AMQPValue::FieldTable(nested))
    );
    assert_eq!(
        header(&job, "custom-bytes"),
        Some(&AMQPValue::ByteArray(ByteArray::from(vec![0u8, 1, 255])))
    );
    assert!(
        matches!(header(&job, "custom-array"), Some(AMQPValue::FieldArray(a)) if a.as_slice().len() == 2)
    );
    assert_eq!(
        header(&job, "x-delay"),
        Some(&AMQPValue::LongInt(-400)),
        "x-delay comes back negated, as the delayed-message plugin delivers it"
    );
    assert_eq!(
        header_text(&job, "x-redisched-topic").as_deref(),
        Some("mail.welcome")
    );
    assert_eq!(header_i64(&job, "x-redisched-attempt"), Some(1));

    assert!(ready.drain(SECOND).await.is_empty(), "delivered once");
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_replace_duplicate_and_replies() {
    let _shared = common::timed::shared().await;
    let config = test_config("ops");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let reply_queue = common::unique("replies");
    broker.declare_queue(&reply_queue).await;
    let mut replies = broker.consume_queue(&reply_queue).await;
    let bridge = InProcess::start(&config);
    let with_reply = |id: &str, corr: &str, headers: &[(&str, AMQPValue)]| {
        props(id, headers)
            .with_reply_to(reply_queue.as_str().into())
            .with_correlation_id(corr.into())
    };

    // Cancel: scheduled in 800 ms, deleted before.
    broker
        .command(
            "t",
            with_reply("cancelled", "c1", &[("x-delay", AMQPValue::LongInt(800))]),
            b"x",
        )
        .await;
    broker
        .command(
            "t",
            with_reply("cancelled", "c2", &[("x-redisched-op", text("delete"))]),
            b"",
        )
        .await;
    broker
        .command(
            "t",
            with_reply("missing", "c3", &[("x-redisched-op", text("delete"))]),
            b"",
        )
        .await;
    // Replace: far-future job replaced by one due now with another body.
    broker
        .command(
            "t",
            with_reply(
                "replaced",
                "c4",
                &[("x-delay", AMQPValue::LongInt(600_000))],
            ),
            b"old",
        )
        .await;
    broker
        .command(
            "t",
            with_reply("replaced", "c5", &[("x-redisched-op", text("replace"))]),
            b"new",
        )
        .await;
    // Duplicate: the second put of the same id keeps the first.
    broker
        .command(
            "t",
            with_reply("dup", "c6", &[("x-delay", AMQPValue::LongInt(300))]),
            b"first",
        )
        .await;
    broker
        .command("t", with_reply("dup", "c7", &[]), b"second")
        .await;

    let mut answers = std::collections::HashMap::new();
    for (_, reply) in replies.collect(7, 10 * SECOND).await {
        let corr = reply
            .properties
            .correlation_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_default();
        let body: serde_json::Value = serde_json::from_slice(&reply.data).expect("json reply");
        answers.insert(corr, body["status"].as_str().unwrap_or("").to_string());
    }
    let status = |c: &str| answers.get(c).map(String::as_str);
    assert_eq!(status("c1"), Some("scheduled"));
    assert_eq!(status("c2"), Some("deleted"));
    assert_eq!(status("c3"), Some("not_found"));
    assert_eq!(status("c4"), Some("scheduled"));
    assert_eq!(status("c5"), Some("replaced"));
    assert_eq!(status("c6"), Some("scheduled"));
    assert_eq!(status("c7"), Some("duplicate"));

    let got = ready.collect(2, 10 * SECOND).await;
    let mut late = ready.drain(1500 * Duration::from_millis(1)).await;
    let mut all = got;
    all.append(&mut late);
    let bodies: Vec<(String, Vec<u8>)> = all
        .iter()
        .map(|(_, d)| (message_id(d), d.data.clone()))
        .collect();
    assert!(
        bodies.contains(&("replaced".into(), b"new".to_vec())),
        "{bodies:?}"
    );
    assert!(
        bodies.contains(&("dup".into(), b"first".to_vec())),
        "{bodies:?}"
    );
    assert_eq!(
        bodies.len(),
        2,
        "the cancelled job never arrives, each other once: {bodies:?}"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_at_in_the_future_and_in_the_past() {
    let _shared = common::timed::shared().await;
    let config = test_config("at");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    let at = now_ms() + 500;
    broker
        .put(
            "t",
            "future",
            b"",
            &[("x-deliver-at", AMQPValue::LongLongInt(at))],
        )
        .await;
    broker
        .put(
            "t",
            "past",
            b"",
            &[("x-deliver-at", text(&(now_ms() - 60_000).to_string()))],
        )
        .await;
    let got = ready.collect(2, 10 * SECOND).await;
    assert_eq!(got.len(), 2);
    assert_eq!(
        message_id(&got[0].1),
        "past",
        "the past one is due now, first"
    );
    let (arrived, future) = &got[1];
    assert_eq!(message_id(future), "future");
    assert!(*arrived >= at, "{} ms early", at - arrived);
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_commands_are_set_aside_with_a_reason_and_the_bridge_keeps_going() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("invalid");
    config.limits.max_body_bytes = 64;
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);

    let cases: Vec<(&str, BasicProperties, Vec<u8>, &str)> = vec![
        (
            "t",
            BasicProperties::default(),
            b"no id".to_vec(),
            "message_id",
        ),
        (
            "t",
            props("bad-delay", &[("x-delay", text("soon"))]),
            b"d".to_vec(),
            "x-delay",
        ),
        (
            "t",
            props(
                "too-far",
                &[("x-delay", AMQPValue::LongLongInt(400 * 86_400_000))],
            ),
            b"f".to_vec(),
            "maximum delay",
        ),
        (
            "t",
            props(
                "both",
                &[
                    ("x-delay", AMQPValue::LongInt(1)),
                    ("x-deliver-at", AMQPValue::LongInt(1)),
                ],
            ),
            b"b".to_vec(),
            "both",
        ),
        (
            "t",
            props("op", &[("x-redisched-op", text("upsert"))]),
            b"o".to_vec(),
            "upsert",
        ),
        ("t", props("big", &[]), vec![7u8; 65], "limit is 64"),
        ("bad{topic}", props("topic", &[]), b"t".to_vec(), "topic"),
    ];
    for (topic, props, body, _) in &cases {
        broker.command(topic, props.clone(), body).await;
    }
    broker.put("t", "valid-after", b"ok", &[]).await;

    let set_aside = invalid.collect(cases.len(), 10 * SECOND).await;
    assert_eq!(set_aside.len(), cases.len());
    for ((_, msg), (topic, _, body, reason)) in set_aside.iter().zip(&cases) {
        let error = header_text(msg, "x-redisched-error").expect("reason header");
        assert!(
            error.contains(reason),
            "{error:?} should mention {reason:?}"
        );
        assert_eq!(&msg.data, body, "body intact");
        assert_eq!(msg.routing_key.as_str(), *topic);
    }
    let (_, job) = ready
        .next(10 * SECOND)
        .await
        .expect("valid command after invalid ones");
    assert_eq!(message_id(&job), "valid-after");
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_jobs_are_kept_and_delivered_once_a_queue_is_bound() {
    let _shared = common::timed::shared().await;
    let config = test_config("unroutable");
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    broker.put("orphan.topic", "kept", b"payload", &[]).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let store = common::test_store_named(&config.redis.prefix).await;
    let topic = redisched::job::Topic::new("orphan.topic").unwrap();
    let job = store
        .get(&topic, &redisched::job::JobId::new("kept").unwrap())
        .await
        .unwrap();
    let job = job.expect("an unroutable job stays in the store");
    assert!(job.attempts >= 1, "it was tried");

    let mut ready = broker.consume_ready("orphan.#").await;
    let (_, delivered) = ready
        .next(10 * SECOND)
        .await
        .expect("delivered after binding");
    assert_eq!(message_id(&delivered), "kept");
    assert!(header_i64(&delivered, "x-redisched-attempt").unwrap_or(0) >= 2);
    assert!(ready.drain(SECOND).await.is_empty());
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_put_by_another_client_through_the_lua_script_is_dispatched_promptly() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("foreign");
    // A long poll interval: only the Pub/Sub notification can make this prompt.
    config.dispatch.poll_interval_ms = 30_000;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let p = &config.redis.prefix;
    let keys = ["scheduled", "reserved", "jobs", "seq"].map(|k| format!("{p}:{{foreign}}:{k}"));
    let mut conn = common::raw_redis();
    let _: i64 = redis::cmd("SADD")
        .arg(format!("{p}:topics"))
        .arg("foreign")
        .query(&mut conn)
        .unwrap();
    let sent = now_ms();
    let reply: redis::Value = redis::cmd("EVAL")
        .arg(include_str!("../../lua/put.lua"))
        .arg(4)
        .arg(&keys)
        .arg(
            &[
                "by-cli",
                "from elsewhere",
                "",
                "nx",
                "delay",
                "300",
                "1000000",
                "1000",
                &format!("{p}:notify"),
            ][..],
        )
        .query(&mut conn)
        .unwrap();
    assert!(format!("{reply:?}").contains("scheduled"), "{reply:?}");

    let (arrived, job) = ready.next(10 * SECOND).await.expect("dispatched");
    assert_eq!(message_id(&job), "by-cli");
    assert!(arrived >= sent + 300);
    assert!(
        arrived - sent < 3_000,
        "took {} ms: not woken by the notification",
        arrived - sent
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_bridges_deliver_each_job_exactly_once() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("pair");
    config.dispatch.batch = 20;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let first = InProcess::start(&config);
    let second = InProcess::start(&config);
    let n = 600;
    for i in 0..n {
        let topic = format!("pair.{}", i % 3);
        broker
            .put(
                &topic,
                &format!("job-{i}"),
                b"x",
                &[("x-delay", AMQPValue::LongInt((i % 50) as i32 * 10))],
            )
            .await;
    }
    let got = ready.collect(n, 30 * SECOND).await;
    let extra = ready.drain(SECOND).await;
    let counts = id_counts(&got);
    assert_eq!(counts.len(), n, "every job delivered");
    assert!(
        extra.is_empty() && counts.values().all(|&c| c == 1),
        "no duplicates in the normal path"
    );
    first.stop().await;
    second.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: bash scripts/test.sh runs it"]
async fn a_bridge_killed_mid_dispatch_loses_nothing_after_restart() {
    let _shared = common::timed::shared().await;
    // One confirm channel, and four taking turns (each with its own confirmer).
    for channels in [1, 4] {
        killed_mid_dispatch(channels).await;
    }
}

async fn killed_mid_dispatch(channels: usize) {
    let mut config = test_config("kill");
    config.dispatch.ttr_ms = 1_000;
    config.dispatch.channels = channels;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let n = 3_000;
    for i in 0..n {
        broker.put("kill", &format!("job-{i}"), b"x", &[]).await;
    }
    let mut bridge = ChildBridge::start(&config);
    let first = ready.collect(200, 30 * SECOND).await;
    assert!(!first.is_empty(), "the bridge started dispatching");
    bridge.kill9();
    let mut restarted = ChildBridge::start(&config);
    let mut got = first;
    got.extend(ready.collect(n * 2, 30 * SECOND).await);
    let mut seen: HashSet<String> = HashSet::new();
    for (_, d) in &got {
        seen.insert(message_id(d));
    }
    let missing: Vec<usize> = (0..n)
        .filter(|i| !seen.contains(&format!("job-{i}")))
        .collect();
    assert!(
        missing.is_empty(),
        "{channels} channel(s): lost {} jobs, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    let duplicates = got.len() - seen.len();
    assert!(
        duplicates <= config.dispatch.window,
        "{channels} channel(s): duplicates {duplicates} bounded by the confirm window"
    );
    let (status, took) = restarted.terminate();
    assert!(status.success(), "SIGTERM exits 0, got {status:?}");
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_recovers_when_the_broker_cancels_its_consumer() {
    let _shared = common::timed::shared().await;
    let config = test_config("cancel");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    broker.put("t", "before", b"", &[]).await;
    assert!(
        ready.next(10 * SECOND).await.is_some(),
        "the bridge consumes"
    );

    // Deleting the queue makes the broker cancel the bridge's consumer (basic.cancel).
    broker
        .channel
        .queue_delete(
            config.amqp.commands_queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .expect("delete the commands queue");
    // The bridge notices, reconnects and declares the queue again.
    let mut probe = broker.connection.create_channel().await.expect("channel");
    let deadline = std::time::Instant::now() + 20 * SECOND;
    loop {
        let declared = probe
            .queue_declare(
                config.amqp.commands_queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(queue) if queue.consumer_count() > 0 => break,
            Ok(_) => {}
            // A failed passive declare closes the channel: open another.
            Err(_) => probe = broker.connection.create_channel().await.expect("channel"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the bridge did not re-declare and consume again"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    broker.put("t", "after", b"", &[]).await;
    let (_, job) = ready.next(10 * SECOND).await.expect("commands flow again");
    assert_eq!(message_id(&job), "after");
    bridge.stop().await;
    broker.cleanup().await;
}

/// Kubernetes injects `REDISCHED_PORT`, `REDISCHED_SERVICE_HOST`, ... into every pod of a
/// namespace with a Service named `redisched`. The bridge must run anyway (and say once
/// which variables it ignored), while real configuration variables still apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_service_variables_do_not_stop_the_bridge() {
    let _shared = common::timed::shared().await;
    let config = test_config("k8s");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let log = std::env::temp_dir().join(format!("{}.log", config.redis.prefix));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("run")
        .envs(env_for(&config))
        .envs([
            ("REDISCHED_PORT", "tcp://10.96.0.12:7171"),
            ("REDISCHED_SERVICE_HOST", "10.96.0.12"),
            ("REDISCHED_SERVICE_PORT", "7171"),
            ("REDISCHED_PORT_7171_TCP_ADDR", "10.96.0.12"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn redisched run");
    broker.put("k8s", "after-start", b"hello", &[]).await;
    let delivered = ready.next(15 * SECOND).await;
    let _ = child.kill();
    let status = child.wait().expect("wait");
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    broker.cleanup().await;
    let (_, job) = delivered.unwrap_or_else(|| panic!("no delivery ({status:?}): {stderr}"));
    assert_eq!(message_id(&job), "after-start");
    assert!(
        stderr.contains("REDISCHED_PORT, REDISCHED_PORT_7171_TCP_ADDR, REDISCHED_SERVICE_HOST"),
        "one warning names the ignored variables: {stderr}"
    );
}

/// Ingest applies batches two at a time: a long stream of replaces and deletes on a few
/// ids, in small batches (so consecutive batches often name the same job), must leave
/// each job as its last command says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_on_one_job_apply_in_delivery_order_across_batches() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("order");
    config.ingest.batch = 7;
    let store = common::test_store_named(&config.redis.prefix).await;
    let broker = Broker::new(&config).await;
    // Published before the bridge starts, so every batch is full and batches overlap.
    let mut last: std::collections::HashMap<(String, String), Option<Vec<u8>>> =
        std::collections::HashMap::new();
    let mut confirms = Vec::new();
    for n in 0..3_000u32 {
        let topic = format!("t{}", n % 2);
        let id = format!("job-{}", (n * 7919) % 23);
        let delete = n % 5 == 3;
        let op = if delete { "delete" } else { "replace" };
        let body = n.to_string().into_bytes();
        let headers = [
            ("x-redisched-op", text(op)),
            ("x-delay", AMQPValue::LongInt(600_000)),
        ];
        confirms.push(
            broker
                .channel
                .basic_publish(
                    config.amqp.commands_exchange.as_str().into(),
                    topic.as_str().into(),
                    lapin::options::BasicPublishOptions::default(),
                    &body,
                    props(&id, &headers),
                )
                .await
                .expect("publish command"),
        );
        last.insert((topic, id), (!delete).then_some(body));
    }
    for confirm in confirms {
        assert!(
            confirm.await.expect("confirm").is_ack(),
            "command confirmed"
        );
    }
    // Run the bridge until the queue is empty; stopping it acks what it applied and
    // returns what it had only prefetched, so an empty queue after the stop means every
    // command was applied.
    let channel = broker.connection.create_channel().await.expect("channel");
    let ready_count = || async {
        channel
            .queue_declare(
                config.amqp.commands_queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("passive declare")
            .message_count()
    };
    let deadline = std::time::Instant::now() + 60 * SECOND;
    loop {
        let bridge = InProcess::start(&config);
        while ready_count().await > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "commands not consumed"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(SECOND).await;
        bridge.stop().await;
        if ready_count().await == 0 {
            break;
        }
    }
    for ((topic, id), want) in &last {
        let got = store
            .get(
                &redisched::job::Topic::new(topic).expect("topic"),
                &redisched::job::JobId::new(id).expect("id"),
            )
            .await
            .expect("get")
            .map(|job| job.body);
        assert_eq!(&got, want, "{topic}/{id} is as its last command says");
    }
    broker.cleanup().await;
}

//! Bad input against a real bridge (the cases that neither
//! `tests/bridge/end_to_end.rs` nor the unit tests of `src/ingest/decode/` cover): odd `x-delay`
//! and `x-deliver-at` values, ids and topics at and past their edges, bodies at and over
//! the limit, a message_id that is not UTF-8 (sent with pika: lapin cannot send one),
//! and a flood of invalid commands that must not starve valid ones.

use crate::common;

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use common::bridge::{
    header_text, id_counts, message_id, now_ms, props, test_config, text, Broker, InProcess,
};
use lapin::options::BasicPublishOptions;
use lapin::types::AMQPValue;
use lapin::BasicProperties;
use redisched::job::{JobId, Topic};

const SECOND: Duration = Duration::from_secs(1);
const DAY: i64 = 86_400_000;

type Headers = Vec<(&'static str, AMQPValue)>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_delays_ids_topics_and_bodies_are_applied_exactly_or_set_aside_with_a_reason() {
    let _shared = common::timed::shared().await;
    let mut config = test_config("badin");
    config.limits.max_body_bytes = 1000;
    let max_delay = config.limits.max_delay_ms;
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    // (topic, id, headers, body, reason fragment): refused with that reason.
    let long_topic = "t".repeat(201);
    let refused: Vec<(&str, String, Headers, Vec<u8>, &str)> = vec![
        (
            "bad",
            "nan".into(),
            vec![("x-delay", text("NaN"))],
            vec![],
            "x-delay",
        ),
        (
            "bad",
            "neg-inf".into(),
            vec![("x-delay", text("-Infinity"))],
            vec![],
            "x-delay",
        ),
        // (A NaN or infinite *double* cannot even be published: RabbitMQ closes the
        // producer's connection with INTERNAL_ERROR, as Erlang has no such floats. The
        // property test in tests/bridge/decode_fuzz.rs covers them.)
        (
            "bad",
            "word".into(),
            vec![("x-delay", text("3 days"))],
            vec![],
            "x-delay",
        ),
        (
            "bad",
            "empty-delay".into(),
            vec![("x-delay", text(""))],
            vec![],
            "x-delay",
        ),
        (
            "bad",
            "bool".into(),
            vec![("x-delay", AMQPValue::Boolean(true))],
            vec![],
            // The value in the producer's terms, not the Rust form `Boolean(true)`.
            "x-delay must be an integer number of milliseconds (or a numeric string), got the boolean true",
        ),
        (
            "bad",
            "over-max".into(),
            vec![("x-delay", AMQPValue::LongLongInt(max_delay + 1))],
            vec![],
            "maximum delay",
        ),
        (
            "bad",
            "over-max-str".into(),
            vec![("x-delay", text(&(max_delay + 1).to_string()))],
            vec![],
            "maximum delay",
        ),
        (
            "bad",
            "over-max-float".into(),
            vec![("x-delay", AMQPValue::Double(max_delay as f64 + 0.5))],
            vec![],
            "maximum delay",
        ),
        (
            "bad",
            "huge".into(),
            vec![("x-delay", AMQPValue::Double(1e300))],
            vec![],
            // Reported as given, not as a saturated integer.
            "x-delay 1e300 is out of range: at most 9999999999999999 ms",
        ),
        (
            "bad",
            "before-1970".into(),
            vec![("x-deliver-at", AMQPValue::LongLongInt(-1))],
            vec![],
            "x-deliver-at -1 is before 1970-01-01T00:00:00Z",
        ),
        // x-deliver-at beyond the maximum delay: refused by put.lua itself.
        (
            "bad",
            "far-at".into(),
            vec![(
                "x-deliver-at",
                AMQPValue::LongLongInt(now_ms() + max_delay + DAY),
            )],
            vec![],
            "delay_too_long",
        ),
        (
            "bad",
            "at-word".into(),
            vec![("x-deliver-at", text("tomorrow"))],
            vec![],
            "x-deliver-at",
        ),
        ("", "empty-topic".into(), vec![], vec![], "topic"),
        (
            long_topic.as_str(),
            "long-topic".into(),
            vec![],
            vec![],
            "topic",
        ),
        ("a{b", "brace-topic".into(), vec![], vec![], "topic"),
        ("a}b", "brace-topic-2".into(), vec![], vec![], "topic"),
        ("bad", "".into(), vec![], vec![], "message_id"),
        ("bad", "line\nbreak".into(), vec![], vec![], "message_id"),
        (
            "bad",
            "over-body".into(),
            vec![],
            vec![b'x'; 1001],
            "limit is 1000",
        ),
    ];
    for (topic, id, headers, body, _) in &refused {
        broker.command(topic, props(id, headers), body).await;
    }

    // Accepted, with the due time the contract promises.
    let edge_topic = "e".repeat(200);
    let wide_id: String = "é".repeat(127); // 254 bytes; message_id is a short string (<= 255)
    let sent = now_ms();
    let accepted: Vec<(&str, String, Headers, Vec<u8>)> = vec![
        (
            "ok",
            "delay-str".into(),
            vec![("x-delay", text("1500"))],
            vec![],
        ),
        (
            "ok",
            "delay-float".into(),
            vec![("x-delay", AMQPValue::Double(1200.2))],
            vec![],
        ),
        (
            "ok",
            "delay-float-str".into(),
            vec![("x-delay", text("1200.5"))],
            vec![],
        ),
        (
            "ok",
            "delay-neg".into(),
            vec![("x-delay", AMQPValue::LongInt(-60_000))],
            vec![],
        ),
        (
            "ok",
            "delay-u8".into(),
            vec![("x-delay", AMQPValue::ShortShortUInt(200))],
            vec![],
        ),
        (
            "ok",
            "at-past".into(),
            vec![("x-deliver-at", AMQPValue::LongLongInt(1))],
            vec![],
        ),
        (
            "ok",
            "at-past-str".into(),
            vec![("x-deliver-at", text("1000"))],
            vec![],
        ),
        ("ok", "a{b}:c".into(), vec![], vec![]),
        ("ok", wide_id.clone(), vec![], vec![]),
        ("ok", "at-body-limit".into(), vec![], vec![b'y'; 1000]),
        (
            "topic:with:colons/and.dots",
            "colons".into(),
            vec![],
            vec![],
        ),
        (edge_topic.as_str(), "edge-topic".into(), vec![], vec![]),
    ];
    for (topic, id, headers, body) in &accepted {
        broker.command(topic, props(id, headers), body).await;
    }
    // Far in the future but within the maximum: stored, not delivered.
    let far_at = now_ms() + max_delay - DAY;
    broker
        .put(
            "later",
            "far-at-ok",
            b"",
            &[("x-deliver-at", AMQPValue::LongLongInt(far_at))],
        )
        .await;
    broker
        .put(
            "later",
            "max-delay",
            b"",
            &[("x-delay", AMQPValue::LongLongInt(max_delay))],
        )
        .await;

    let set_aside = invalid.collect(refused.len(), 30 * SECOND).await;
    assert_eq!(
        set_aside.len(),
        refused.len(),
        "every invalid command set aside"
    );
    for ((_, msg), (topic, id, _, body, reason)) in set_aside.iter().zip(&refused) {
        let error = header_text(msg, "x-redisched-error").unwrap_or_default();
        assert!(
            error.contains(reason),
            "{id:?}: {error:?} should mention {reason:?}"
        );
        assert_eq!(message_id(msg), *id);
        assert_eq!(msg.routing_key.as_str(), *topic);
        assert_eq!(&msg.data, body, "body intact");
    }

    let got = ready.collect(accepted.len(), 30 * SECOND).await;
    let counts = id_counts(&got);
    for (topic, id, headers, body) in &accepted {
        assert_eq!(
            counts.get(id.as_str()),
            Some(&1),
            "{id:?} delivered once: {counts:?}"
        );
        let (arrived, msg) = got
            .iter()
            .find(|(_, d)| message_id(d) == *id)
            .expect("found");
        assert_eq!(msg.routing_key.as_str(), *topic);
        assert_eq!(&msg.data, body);
        let min_delay = match headers.first() {
            Some((_, AMQPValue::Double(_))) | Some((_, AMQPValue::LongString(_)))
                if id.starts_with("delay") =>
            {
                if id == "delay-str" {
                    1500
                } else {
                    1201
                }
            }
            Some((_, AMQPValue::ShortShortUInt(v))) => i64::from(*v),
            _ => 0,
        };
        assert!(
            *arrived >= sent + min_delay,
            "{id:?} early: {} ms < {min_delay}",
            arrived - sent
        );
    }
    assert!(
        ready.drain(2 * SECOND).await.is_empty(),
        "nothing else delivered"
    );

    let later = Topic::new("later").unwrap();
    let job = store
        .get(&later, &JobId::new("far-at-ok").unwrap())
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(job.due_at, far_at);
    let job = store
        .get(&later, &JobId::new("max-delay").unwrap())
        .await
        .unwrap()
        .expect("stored");
    assert!(
        job.due_at >= sent + max_delay,
        "the maximum delay itself is accepted"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

/// lapin cannot send a message_id (an AMQP short string) that is not UTF-8, but other
/// clients can: pika sends bytes as they are, and RabbitMQ passes them on. lapin's frame
/// parser then refuses the delivery (`failed to parse: MapRes`), the bridge's AMQP
/// session ends, it reconnects, the message is redelivered: a poison message that
/// would block every command behind it. The commands queue is a quorum queue with
/// `x-delivery-limit`, so the broker dead-letters it to the invalid exchange after a
/// few deliveries and the commands behind it go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_that_is_not_utf8_does_not_block_the_commands_after_it() {
    let _shared = common::timed::shared().await;
    let has_pika = Command::new("python3")
        .args(["-c", "import pika"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_pika,
        "python3 with pika is needed: pip install pika (scripts/test.sh does it)"
    );
    init_logging();
    let config = test_config("utf8");
    let broker = Broker::new(&config).await;
    // Not lapin on the invalid queue: it could not read the poison message either.
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    broker.put("u", "before", b"", &[]).await;
    let script = r#"
import sys, pika
params = pika.URLParameters(sys.argv[1])
conn = pika.BlockingConnection(params)
ch = conn.channel()
ch.confirm_delivery()
ch.basic_publish(sys.argv[2], "u", b"body", pika.BasicProperties(message_id=b"bad-\xff\xfe-id"))
ch.basic_publish(sys.argv[2], "u\xe9", b"body", pika.BasicProperties(message_id="bad-topic"))
conn.close()
"#;
    let out = Command::new("python3")
        .args([
            "-c",
            script,
            &config.amqp.url,
            &config.amqp.commands_exchange,
        ])
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "pika: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    broker.put("u", "after", b"", &[]).await;

    // Up to five redeliveries of the poison message, each ending a session that
    // reconnects with backoff (1 s doubling): half a minute or more on a busy machine.
    let got = ready.collect(2, 90 * SECOND).await;
    let ids: HashSet<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    assert!(
        ids.contains("before") && ids.contains("after"),
        "valid commands delivered: {ids:?}"
    );
    // The non-UTF-8 id and the non-ASCII topic are set aside, never applied: the topic
    // by the bridge (x-redisched-error), the id by the broker after the delivery limit
    // (x-death), since no lapin client can read it. Read them back with pika.
    let reader = r#"
import sys, json, pika
ch = pika.BlockingConnection(pika.URLParameters(sys.argv[1])).channel()
reasons = []
for _ in range(2):
    method, props, body = ch.basic_get(sys.argv[2], auto_ack=True)
    if method is None:
        break
    h = props.headers or {}
    death = (h.get("x-death") or [{}])[0].get("reason")
    reasons.append(h.get("x-redisched-error") or (death.decode() if isinstance(death, bytes) else death) or "")
print(json.dumps(reasons))
"#;
    let mut reasons: Vec<String> = Vec::new();
    for _ in 0..40 {
        let out = Command::new("python3")
            .args(["-c", reader, &config.amqp.url, &config.amqp.invalid_queue])
            .output()
            .expect("run python3");
        let mut more: Vec<String> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        reasons.append(&mut more);
        if reasons.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(reasons.len(), 2, "both set aside: {reasons:?}");
    assert!(
        reasons.iter().all(|r| !r.is_empty()),
        "each with a reason: {reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r == "delivery_limit"),
        "the unreadable one was dead-lettered at the delivery limit: {reasons:?}"
    );
    assert!(ready.drain(SECOND).await.is_empty());
    bridge.stop().await;
    broker.cleanup().await;
}

/// 5,000 invalid commands with 100 valid ones interleaved: every valid one is delivered
/// in bounded time and every invalid one is set aside with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_invalid_commands_does_not_starve_valid_ones() {
    let _shared = common::timed::shared().await;
    let config = test_config("flood");
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    let (n_invalid, n_valid) = (5_000usize, 100usize);
    let every = n_invalid / n_valid;
    let started = Instant::now();
    let mut confirms = Vec::with_capacity(n_invalid + n_valid);
    let mut valid_sent_at = Vec::new();
    for i in 0..n_invalid {
        let bad = match i % 4 {
            0 => ("f", props(&format!("bad-{i}"), &[("x-delay", text("NaN"))])),
            1 => ("f", BasicProperties::default()),
            2 => ("f{x}", props(&format!("bad-{i}"), &[])),
            _ => (
                "f",
                props(&format!("bad-{i}"), &[("x-redisched-op", text("upsert"))]),
            ),
        };
        confirms.push(publish(&broker, bad.0, bad.1).await);
        if i % every == every - 1 {
            let n = valid_sent_at.len();
            valid_sent_at.push(now_ms());
            confirms.push(publish(&broker, "f.ok", props(&format!("ok-{n}"), &[])).await);
        }
    }
    for confirm in confirms {
        assert!(confirm.await.expect("confirm").is_ack());
    }
    let published_in = started.elapsed();
    let got = ready.collect(n_valid, 120 * SECOND).await;
    let counts = id_counts(&got);
    assert_eq!(counts.len(), n_valid, "every valid command delivered");
    let last_valid = got.iter().map(|(at, _)| *at).max().unwrap_or(0);
    let aside = invalid.collect(n_invalid, 120 * SECOND).await;
    assert_eq!(aside.len(), n_invalid, "every invalid command set aside");
    assert!(aside
        .iter()
        .all(|(_, d)| header_text(d, "x-redisched-error").is_some_and(|r| !r.is_empty())));
    let lag: Vec<i64> = got
        .iter()
        .map(|(at, d)| {
            let n: usize = message_id(d).trim_start_matches("ok-").parse().unwrap_or(0);
            at - valid_sent_at[n]
        })
        .collect();
    let worst = lag.iter().max().copied().unwrap_or(0);
    println!(
        "flood: {n_invalid} invalid + {n_valid} valid published in {published_in:?}; last valid delivered {} ms after the last publish; worst publish-to-delivery {worst} ms",
        last_valid - valid_sent_at.last().copied().unwrap_or(0)
    );
    // Bounded: the valid ones wait only for the invalid ones ahead of them in the queue.
    assert!(worst < 60_000, "worst publish-to-delivery {worst} ms");
    bridge.stop().await;
    broker.cleanup().await;
}

async fn publish(broker: &Broker, topic: &str, props: BasicProperties) -> lapin::PublisherConfirm {
    broker
        .channel
        .basic_publish(
            broker.config.amqp.commands_exchange.as_str().into(),
            topic.into(),
            BasicPublishOptions::default(),
            b"x",
            props,
        )
        .await
        .expect("publish")
}

fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "redisched=info,lapin=warn",
        ))
        .with_test_writer()
        .try_init();
}

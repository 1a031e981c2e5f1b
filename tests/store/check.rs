//! Redis in an unexpected state: keys of the wrong type, half-written and unreadable
//! records, orphan ids — written by raw redis commands. The scripts refuse with a clear
//! error, the bridge reports it and goes on with its other topics, and `redisched check`
//! (lua/check.lua) finds every problem and with `--repair` restores the invariant
//! without deleting anything.

use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::bridge::{header_text, message_id, test_config, Broker, InProcess};
use common::{raw_redis, test_store, DEFAULT_LIMITS};
use lapin::types::AMQPValue;
use redis::Commands;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{CheckReport, Op, PutRequest, Store, CHECK_STEP};

const SECOND: Duration = Duration::from_secs(1);

fn topic(name: &str) -> Topic {
    Topic::new(name).expect("topic")
}

fn key(prefix: &str, topic: &str, what: &str) -> String {
    format!("{prefix}:{{{topic}}}:{what}")
}

fn put(topic_name: &str, id: &str, due: Due) -> Op {
    Op::Put(PutRequest {
        topic: topic(topic_name),
        id: JobId::new(id).expect("id"),
        body: format!("body of {id}").into_bytes(),
        meta: Vec::new(),
        due,
        mode: PutMode::Keep,
    })
}

async fn apply(store: &Store, ops: &[Op]) {
    for result in store.apply(ops).await.expect("apply") {
        result.expect("applied");
    }
}

fn kinds(report: &CheckReport) -> Vec<(String, String)> {
    let mut kinds: Vec<_> = report
        .problems
        .iter()
        .map(|p| (p.kind.clone(), p.id.clone()))
        .collect();
    kinds.sort();
    kinds
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<_> = pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_every_kind_of_damage_and_repair_restores_the_invariant() {
    let store = test_store().await;
    let p = store.prefix.clone();
    let far = Due::Delay(3_600_000);
    apply(
        &store,
        &[
            put("mixed", "good-1", far),
            put("mixed", "good-2", far),
            put("mixed", "reserved-1", Due::NOW),
        ],
    )
    .await;
    let batch = store
        .reserve(&topic("mixed"), Duration::from_secs(600), 10)
        .await
        .expect("reserve");
    assert_eq!(batch.jobs.len(), 1);
    let clean = store.check(&topic("mixed"), false).await.expect("check");
    assert!(clean.problems.is_empty(), "a sound topic: {clean:?}");
    assert_eq!(
        clean.examined,
        3 + 2 + 1,
        "3 records, 2 scheduled, 1 reserved"
    );

    // Damage written as raw commands, as a crashed older writer or a human would.
    let mut r = raw_redis();
    let (sched, resv, jobs) = (
        key(&p, "mixed", "scheduled"),
        key(&p, "mixed", "reserved"),
        key(&p, "mixed", "jobs"),
    );
    let now: i64 = store.server_time().await.expect("time");
    let half_written = format!("1|{}|0|0|0|half", now + 60_000);
    let _: () = r.hset(&jobs, "half-written", &half_written).unwrap();
    let _: () = r
        .hset(&jobs, "garbage", b"\x00\xffnot a record".as_slice())
        .unwrap();
    let _: () = r.zadd(&sched, "garbage", now + 5_000).unwrap();
    let _: () = r.hset(&jobs, "truncated", "1|5|0|0|99|short").unwrap();
    let _: () = r.zadd(&sched, "orphan-s", now).unwrap();
    let _: () = r.zadd(&resv, "orphan-r", now).unwrap();
    let _: () = r.zadd(&resv, "good-2", now + 600_000).unwrap(); // now in both sets

    let expected = owned(&[
        ("unindexed", "half-written"),
        ("unreadable_record", "garbage"),
        ("unreadable_record", "truncated"),
        ("orphan_scheduled", "orphan-s"),
        ("orphan_reserved", "orphan-r"),
        ("in_both", "good-2"),
    ]);
    let report = store.check(&topic("mixed"), false).await.expect("check");
    assert_eq!(kinds(&report), expected, "{report:#?}");
    assert!(report.problems.iter().all(|p| !p.repaired));
    assert_eq!(report.unrepaired(), expected.len());
    let again = store.check(&topic("mixed"), false).await.expect("check");
    assert_eq!(kinds(&again), expected, "report mode changed nothing");

    // get.lua names the state of the half-written job; reserve never sees it.
    let info = store
        .get(&topic("mixed"), &JobId::new("half-written").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.state, redisched::store::JobState::Unindexed);

    let repaired = store.check(&topic("mixed"), true).await.expect("repair");
    assert_eq!(kinds(&repaired), expected);
    assert!(
        repaired.problems.iter().all(|p| p.repaired),
        "{repaired:#?}"
    );
    assert_eq!(repaired.damaged, 2, "two unreadable records set aside");
    let after = store.check(&topic("mixed"), false).await.expect("check");
    assert!(
        after.problems.is_empty(),
        "repair restored the invariant: {after:#?}"
    );

    // Nothing lost: the unreadable records are in the damaged hash byte for byte; the
    // half-written job is scheduled at its own due time (not earlier).
    let damaged = key(&p, "mixed", "damaged");
    let saved: Vec<u8> = r.hget(&damaged, "record:garbage").unwrap();
    assert_eq!(saved, b"\x00\xffnot a record");
    let saved: String = r.hget(&damaged, "record:truncated").unwrap();
    assert_eq!(saved, "1|5|0|0|99|short");
    let score: f64 = r.zscore(&sched, "half-written").unwrap();
    assert_eq!(score as i64, now + 60_000);
    let stats = store.stats(&topic("mixed")).await.unwrap();
    assert_eq!(stats.records, stats.scheduled + stats.reserved);
    assert_eq!(
        (stats.scheduled, stats.reserved),
        (2, 2),
        "good-1, half-written | reserved-1, good-2"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_the_wrong_type_are_refused_clearly_and_repair_sets_them_aside() {
    let store = test_store().await;
    let p = store.prefix.clone();
    let mut r = raw_redis();
    // `jobs` is a string, `seq` of another topic is not a number.
    let _: () = r.set(key(&p, "wrong", "jobs"), "I am not a hash").unwrap();
    let _: () = r.set(key(&p, "badseq", "seq"), "abc").unwrap();
    apply(&store, &[put("badseq", "x", Due::NOW)]).await;

    // The scripts refuse with WRONGTYPE (a rejection, not "unavailable": nothing to retry).
    let refused = store
        .apply(&[put("wrong", "y", Due::NOW)])
        .await
        .expect("redis is up");
    let err = refused[0].clone().expect_err("wrong type refused");
    assert_eq!(err.code, redisched::store::RejectCode::WrongType, "{err}");
    let err = store
        .reserve(&topic("badseq"), SECOND, 10)
        .await
        .expect_err("seq is not a number");
    assert!(!err.is_unavailable(), "{err}");

    let report = store.check(&topic("wrong"), false).await.expect("check");
    assert_eq!(kinds(&report), owned(&[("wrong_type", "jobs")]));
    assert!(report.problems[0].detail.contains("string"), "{report:?}");
    let report = store.check(&topic("badseq"), false).await.expect("check");
    assert_eq!(kinds(&report), owned(&[("wrong_type", "seq")]));

    for name in ["wrong", "badseq"] {
        let repaired = store.check(&topic(name), true).await.expect("repair");
        assert_eq!(repaired.unrepaired(), 0, "{repaired:?}");
        assert!(store
            .check(&topic(name), false)
            .await
            .unwrap()
            .problems
            .is_empty());
    }
    // The wrong-typed value is kept as a DUMP that RESTORE brings back.
    let fields: Vec<String> = r.hkeys(key(&p, "wrong", "damaged")).unwrap();
    assert_eq!(fields.len(), 1);
    assert!(fields[0].starts_with("key:jobs:"), "{fields:?}");
    let dump: Vec<u8> = r.hget(key(&p, "wrong", "damaged"), &fields[0]).unwrap();
    let restored = key(&p, "wrong", "restored");
    let _: () = redis::cmd("RESTORE")
        .arg(&restored)
        .arg(0)
        .arg(dump)
        .query(&mut r)
        .unwrap();
    let value: String = r.get(&restored).unwrap();
    assert_eq!(value, "I am not a hash");

    // Both topics work again; the new seq is above every token handed out before.
    apply(&store, &[put("wrong", "y", Due::NOW)]).await;
    let batch = store
        .reserve(&topic("badseq"), SECOND, 10)
        .await
        .expect("reserve works again");
    assert_eq!(batch.jobs.len(), 1);
    assert!(
        batch.jobs[0].token > 1_000_000_000_000,
        "token {}",
        batch.jobs[0].token
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_walks_big_topics_in_steps_and_finds_everything() {
    let store = test_store().await;
    let p = store.prefix.clone();
    let n = CHECK_STEP * 6 + 17;
    let ops: Vec<Op> = (0..n)
        .map(|i| put("big", &format!("job-{i}"), Due::Delay(3_600_000)))
        .collect();
    for chunk in ops.chunks(500) {
        apply(&store, chunk).await;
    }
    let mut r = raw_redis();
    let mut orphans = Vec::new();
    for i in (0..n).step_by(97) {
        let id = format!("job-{i}");
        let _: () = r.hdel(key(&p, "big", "jobs"), &id).unwrap();
        orphans.push(("orphan_scheduled".to_string(), id));
    }
    orphans.sort();
    let report = store.check(&topic("big"), false).await.expect("check");
    assert_eq!(kinds(&report), orphans);
    assert!(
        report.examined >= (2 * n - orphans.len()) as u64,
        "examined {}",
        report.examined
    );
    store.check(&topic("big"), true).await.expect("repair");
    assert!(store
        .check(&topic("big"), false)
        .await
        .unwrap()
        .problems
        .is_empty());
    assert_eq!(
        store.stats(&topic("big")).await.unwrap().scheduled as usize,
        n - orphans.len()
    );
}

fn cli(prefix: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redisched"));
    for (k, _) in std::env::vars() {
        if k.starts_with("REDISCHED_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd
        .env("REDISCHED_REDIS__URL", common::redis_url())
        .env("REDISCHED_REDIS__PREFIX", prefix)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run redisched");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_command_exits_non_zero_until_repaired() {
    let store = test_store().await;
    let p = store.prefix.clone();
    apply(
        &store,
        &[
            put("a", "ok", Due::Delay(60_000)),
            put("b", "ok", Due::Delay(60_000)),
        ],
    )
    .await;
    let (code, out, err) = cli(&p, &["check"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("the store is sound"), "{out}");

    let mut r = raw_redis();
    let _: () = r.zadd(key(&p, "b", "scheduled"), "ghost", 1).unwrap();
    let (code, out, _) = cli(&p, &["check", "--json"]);
    assert_eq!(code, Some(6), "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(json["unrepaired"], 1, "{json}");
    assert_eq!(
        json["topics"][1]["problems"][0]["kind"], "orphan_scheduled",
        "{json}"
    );
    let (code, _, err) = cli(&p, &["check", "b"]);
    assert_eq!(code, Some(6));
    assert!(
        err.contains("orphan_scheduled") && err.contains("--repair"),
        "{err}"
    );
    let (code, out, _) = cli(&p, &["check", "a"]);
    assert_eq!(code, Some(0), "only b is damaged: {out}");

    let (code, out, err) = cli(&p, &["check", "--repair"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("[repaired]") && out.contains("all repaired"),
        "{out}"
    );
    let (code, _, _) = cli(&p, &["check"]);
    assert_eq!(code, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_topic_is_reported_and_the_bridge_goes_on_with_the_others() {
    let config = test_config("damaged");
    let p = config.redis.prefix.clone();
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let mut ready = broker.consume_ready("#").await;
    let store = common::test_store_named(&p).await;
    // Damage before the bridge starts: one topic's jobs key is a list, another's
    // scheduled set has an orphan and an unreadable record is due.
    let mut r = raw_redis();
    let _: () = r.rpush(key(&p, "broken", "jobs"), "x").unwrap();
    let _: () = r.sadd(format!("{p}:topics"), "broken").unwrap();
    let _: () = r.zadd(key(&p, "broken", "scheduled"), "old", 1).unwrap();
    let _: () = r
        .hset(key(&p, "rotten", "jobs"), "bad", "2|garbage")
        .unwrap();
    let _: () = r.zadd(key(&p, "rotten", "scheduled"), "bad", 1).unwrap();
    let _: () = r.sadd(format!("{p}:topics"), "rotten").unwrap();
    let bridge = InProcess::start(&config);

    broker.put("broken", "refused", b"b", &[]).await;
    for i in 0..20 {
        let topic = if i % 2 == 0 { "healthy.a" } else { "rotten" };
        let delay = AMQPValue::LongInt(i * 50);
        broker
            .put(topic, &format!("job-{i}"), b"x", &[("x-delay", delay)])
            .await;
    }
    let got = ready.collect(20, 30 * SECOND).await;
    let mut ids: Vec<String> = got.iter().map(|(_, d)| message_id(d)).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(
        ids.len(),
        20,
        "healthy jobs (also of a topic with an unreadable record) delivered: {ids:?}"
    );
    let (_, set_aside) = invalid
        .next(10 * SECOND)
        .await
        .expect("the put into the broken topic is set aside");
    assert_eq!(message_id(&set_aside), "refused");
    let reason = header_text(&set_aside, "x-redisched-error").unwrap_or_default();
    assert!(
        reason.to_lowercase().contains("wrong"),
        "a clear reason: {reason}"
    );

    // check --repair while the bridge runs; then the broken topic works again.
    let (code, out, _) = cli(&p, &["check", "--json"]);
    assert_eq!(code, Some(6), "{out}");
    let (code, out, err) = cli(&p, &["check", "--repair"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, out, _) = cli(&p, &["check"]);
    assert_eq!(code, Some(0), "{out}");
    broker.put("broken", "after-repair", b"b", &[]).await;
    let (_, job) = ready
        .next(15 * SECOND)
        .await
        .expect("broken topic delivers after repair");
    assert_eq!(message_id(&job), "after-repair");
    let stats = store.stats(&topic("rotten")).await.unwrap();
    assert_eq!(stats.records, stats.scheduled + stats.reserved);
    let _ = DEFAULT_LIMITS;
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_whose_schedule_has_the_wrong_type_does_not_stall_the_others() {
    let config = test_config("headless");
    let p = config.redis.prefix.clone();
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    // A topic whose scheduled set is a string: even looking at its head fails, and
    // so does requeueing it.
    let mut r = raw_redis();
    let _: () = r
        .set(key(&p, "headless", "scheduled"), "not a zset")
        .unwrap();
    let _: () = r
        .set(key(&p, "headless", "reserved"), "not a zset either")
        .unwrap();
    let _: () = r.sadd(format!("{p}:topics"), "headless").unwrap();
    let bridge = InProcess::start(&config);
    for i in 0..10 {
        broker
            .put("healthy.b", &format!("job-{i}"), b"x", &[])
            .await;
    }
    let got = ready.collect(10, 20 * SECOND).await;
    assert_eq!(
        got.len(),
        10,
        "healthy topics are delivered beside a broken one"
    );
    let (code, out, err) = cli(&p, &["check", "--repair"]);
    assert_eq!(code, Some(0), "{out}{err}");
    broker.put("headless", "after-repair", b"b", &[]).await;
    let (_, job) = ready
        .next(15 * SECOND)
        .await
        .expect("delivered after repair");
    assert_eq!(message_id(&job), "after-repair");
    bridge.stop().await;
    broker.cleanup().await;
}

//! Cancel by id prefix (`lua/delete_prefix.lua`, `Store::delete_prefix`): every job whose
//! id starts with the prefix goes, wherever it is (waiting, reserved, parked, failing),
//! nothing else does, glob characters are plain characters, every removal is in the
//! history, and no step of the walk is slow however large the topic.

use crate::common;

use std::time::Duration;

use common::faults::PrivateRedis;
use redisched::job::{Due, IdPrefix, JobId, PutMode, Topic, MIN_PREFIX_CHARS};
use redisched::store::{ConnectOptions, JobState, Outcome, PutRequest, Store, PREFIX_STEP};
use redisched_testkit::percentile;

fn prefix(p: &str) -> IdPrefix {
    IdPrefix::new(p, true).unwrap()
}

fn put(topic: &Topic, id: &str, delay_ms: u64) -> PutRequest {
    PutRequest {
        topic: topic.clone(),
        id: JobId::new(id).unwrap(),
        body: format!("body of {id}").into_bytes(),
        meta: Vec::new(),
        due: Due::delay("delay", delay_ms, i128::from(delay_ms)).unwrap(),
        mode: PutMode::Replace,
    }
}

async fn ids(store: &Store, topic: &Topic, candidates: &[&str]) -> Vec<String> {
    let mut present = Vec::new();
    for id in candidates {
        if store
            .get(topic, &JobId::new(*id).unwrap())
            .await
            .expect("get")
            .is_some()
        {
            present.push((*id).to_string());
        }
    }
    present
}

#[tokio::test]
async fn only_ids_with_the_prefix_go_wherever_they_are() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let mail = Topic::new("mail").unwrap();
    let all = [
        "need_some_help_email_42",
        "need_some_help_email_42_b",
        "need_some_help_email_420",
        "need_some_help_email_7",
        "other_need_some_help_email_42",
        "need_some_help_email_4",
    ];
    for id in all {
        store.put(put(&mail, id, 60_000)).await.expect("put");
    }
    // One of them is reserved right now, one due and reserved later fails and parks.
    store
        .put(put(&mail, "need_some_help_email_42_c", 0))
        .await
        .expect("put");
    let batch = store
        .reserve(&mail, Duration::from_secs(30), 10)
        .await
        .expect("reserve");
    assert_eq!(batch.jobs.len(), 1, "the due one is reserved");

    let deleted = store
        .delete_prefix(&mail, &prefix("need_some_help_email_42"), None)
        .await
        .expect("delete_prefix");
    assert_eq!(deleted, 4, "42, 42_b, 420 and the reserved 42_c");
    let left = ids(&store, &mail, &all).await;
    assert_eq!(
        left,
        [
            "need_some_help_email_7",
            "other_need_some_help_email_42",
            "need_some_help_email_4"
        ]
    );
    let stats = store.stats(&mail).await.expect("stats");
    assert_eq!((stats.scheduled, stats.reserved, stats.records), (3, 0, 3));

    let history = store.history(&mail, None, 20).await.expect("history");
    let by_prefix: Vec<_> = history
        .iter()
        .filter(|e| e.outcome == Outcome::Deleted)
        .collect();
    assert_eq!(by_prefix.len(), 4, "{history:?}");
    assert!(by_prefix
        .iter()
        .all(|e| e.detail == "prefix need_some_help_email_42"));

    // Again: nothing left to delete, and other topics were never touched.
    assert_eq!(
        store
            .delete_prefix(&mail, &prefix("need_some_help_email_42"), None)
            .await
            .expect("again"),
        0
    );
}

#[tokio::test]
async fn glob_characters_in_a_prefix_are_plain_characters() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let topic = Topic::new("globs").unwrap();
    for id in ["a*b", "a*c", "axb", "a?1", "a[1]x", "a[1]", "a1", "a\\z"] {
        store.put(put(&topic, id, 60_000)).await.expect("put");
    }
    for (prefix, expect) in [("a*", 2), ("a?", 1), ("a[1]", 2), ("a\\", 1)] {
        let deleted = store
            .delete_prefix(&topic, &self::prefix(prefix), None)
            .await
            .expect("delete");
        assert_eq!(deleted, expect, "prefix {prefix:?}");
    }
    let left = ids(&store, &topic, &["axb", "a1"]).await;
    assert_eq!(left, ["axb", "a1"]);
}

#[tokio::test]
async fn parked_and_failing_jobs_go_too_and_the_indexes_stay_sound() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let topic = Topic::new("parking").unwrap();
    store
        .put(put(&topic, "user-9-welcome", 0))
        .await
        .expect("put");
    store
        .put(put(&topic, "user-9-digest", 0))
        .await
        .expect("put");
    let batch = store
        .reserve(&topic, Duration::from_secs(30), 10)
        .await
        .expect("reserve");
    for job in &batch.jobs {
        let lease = redisched::store::Lease {
            topic: topic.clone(),
            id: job.id.clone(),
            token: job.token,
        };
        // The first parks at once (max_attempts 1); the second just records a failure.
        let max = if job.id.as_str().ends_with("welcome") {
            1
        } else {
            5
        };
        store
            .retry_failed(&lease, Duration::from_secs(60), "unroutable: NO_ROUTE", max)
            .await
            .expect("retry_failed");
    }
    let welcome = store
        .get(&topic, &JobId::new("user-9-welcome").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(welcome.state, JobState::Parked);
    let before = store.stats(&topic).await.unwrap();
    assert_eq!((before.parked, before.failing), (1, 2));

    assert_eq!(
        store
            .delete_prefix(&topic, &prefix("user-9-"), None)
            .await
            .unwrap(),
        2
    );
    let after = store.stats(&topic).await.unwrap();
    assert_eq!(
        (
            after.scheduled,
            after.reserved,
            after.parked,
            after.failing,
            after.records
        ),
        (0, 0, 0, 0, 0)
    );
    let report = store.check(&topic, false).await.expect("check");
    assert!(report.problems.is_empty(), "{report:?}");
}

#[tokio::test]
async fn the_script_refuses_bad_arguments() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let topic = Topic::new("args").unwrap();
    for cursor in ["x", "-1", ""] {
        let err = store
            .delete_prefix_step(&topic, &prefix("okay"), cursor, 10, None)
            .await
            .expect_err("refused");
        assert!(
            err.to_string().contains("INVALID_ARGUMENT") || err.to_string().contains("invalid"),
            "{err}"
        );
    }
    // The faces' rule: 1..256 bytes of id characters, and 3 characters unless forced.
    assert_eq!(MIN_PREFIX_CHARS, 3);
    assert!(IdPrefix::new("ab", false)
        .unwrap_err()
        .to_string()
        .contains("force"));
    assert!(IdPrefix::new("ab", true).is_ok());
    assert!(IdPrefix::new("abc", false).is_ok());
    assert!(IdPrefix::new("", true).is_err());
    assert!(IdPrefix::new("a\u{7}b", true).is_err());
    assert!(IdPrefix::new("é".repeat(129), true).is_err(), "258 bytes");
}

/// The main thread's CPU time and run-queue wait so far (ns), from the scheduler's own
/// accounting: a step's CPU is the work the script did, whatever the machine's load.
fn redis_schedstat(pid: u32) -> (u64, u64) {
    let path = format!("/proc/{pid}/task/{pid}/schedstat");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e} (a Linux kernel with schedstat is needed)"));
    let mut fields = text
        .split_whitespace()
        .map(|f| f.parse::<u64>().unwrap_or(0));
    (fields.next().unwrap_or(0), fields.next().unwrap_or(0))
}

/// A step's Redis CPU may not exceed this (ns): no script over 5 ms.
const STEP_CPU_BOUND_NS: u64 = 5_000_000;

/// Every step's work is bounded however large the topic: at most 20 removals and
/// [`PREFIX_STEP`] entries examined, so the steps of a sparse prefix stay cheap and a
/// prefix naming every job takes more steps, not longer ones. Asserted: no step uses
/// over 5 ms of the Redis main thread's CPU (schedstat, read around each call on a
/// private server). Printed beside it: Redis' own SLOWLOG (wall time, which also counts
/// the machine taking Redis off the CPU) and the run-queue wait of the slow calls.
/// `PREFIX_JOBS` sets the topic size (default 100,000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_is_bounded_on_a_large_topic() {
    let _alone = common::timed::alone().await;
    let jobs: u64 = std::env::var("PREFIX_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let redis = PrivateRedis::start();
    let options = ConnectOptions {
        url: redis.url(),
        prefix: "big".into(),
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(10),
        tls_ca_file: None,
    };
    let store = Store::connect(&options, common::DEFAULT_LIMITS)
        .await
        .expect("private redis");
    let topic = Topic::new("signups").unwrap();
    // Bulk-load format-1 records straight into the keys (put.lua would take minutes):
    // ids user_<n % 1000>_<n>, so each user prefix names 0.1 % of the topic.
    let mut conn = redis.connection();
    let load = r#"
        for n = tonumber(ARGV[1]), tonumber(ARGV[2]) do
          local id = 'user_' .. (n % 1000) .. '_' .. n
          redis.call('HSET', KEYS[1], id, '1|4102444800000|0|0|0|' .. string.rep('x', 100))
          redis.call('ZADD', KEYS[2], 4102444800000, id)
        end"#;
    let (jobs_key, scheduled_key) = ("big:{signups}:jobs", "big:{signups}:scheduled");
    let mut start = 0;
    while start < jobs {
        let end = (start + 20_000).min(jobs) - 1;
        let _: () = redis::cmd("EVAL")
            .arg(load)
            .arg(2)
            .arg(jobs_key)
            .arg(scheduled_key)
            .arg(start)
            .arg(end)
            .query(&mut conn)
            .expect("bulk load");
        start = end + 1;
    }
    // Calls over 1 ms are logged (not every call: logging each of the scripts' inner
    // commands too would slow the steps and overflow the log); the mean per call comes
    // from INFO commandstats.
    // The script's own work is measured: the AOF this server keeps for the fault tests
    // is written after each call, in the event loop, and is a deployment's choice.
    for (key, value) in [
        ("appendonly", "no"),
        ("slowlog-log-slower-than", "1000"),
        ("slowlog-max-len", "1000000"),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(key)
            .arg(value)
            .query(&mut conn)
            .unwrap();
    }
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut conn)
        .unwrap();

    // Step by step, as Store::delete_prefix does, checking each step's bound.
    // (step CPU ns, run-queue wait ns, round trip) of every step of both walks.
    let mut costs: Vec<(u64, u64, Duration)> = Vec::new();
    let pid = redis.pid();
    let mut walk = async |prefix: &'static str| {
        let (mut cursor, mut total, mut steps) = ("0".to_string(), 0, 0);
        let started = std::time::Instant::now();
        loop {
            let (cpu, wait) = redis_schedstat(pid);
            let sent = std::time::Instant::now();
            let step = store
                .delete_prefix_step(&topic, &self::prefix(prefix), &cursor, PREFIX_STEP, None)
                .await
                .expect("step");
            let round_trip = sent.elapsed();
            let (cpu_after, wait_after) = redis_schedstat(pid);
            costs.push((cpu_after - cpu, wait_after - wait, round_trip));
            assert!(step.deleted <= 20, "a step removed {}", step.deleted);
            total += step.deleted;
            steps += 1;
            if step.done {
                return (total, steps, started.elapsed());
            }
            cursor = step.cursor;
        }
    };
    let (one_user, one_steps, one_took) = walk("user_7_").await;
    let expected_one = (0..jobs).filter(|n| n % 1000 == 7).count() as u64;
    assert_eq!(one_user, expected_one);
    let (everyone, all_steps, all_took) = walk("user_").await;
    assert_eq!(one_user + everyone, jobs, "every job went");
    assert!(all_steps >= everyone / 20, "at most 20 removals per step");

    let slow: Vec<i64> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query::<Vec<redis::Value>>(&mut conn)
        .unwrap()
        .into_iter()
        .filter_map(|entry| {
            let redis::Value::Array(fields) = entry else {
                return None;
            };
            let micros = redis::from_redis_value::<i64>(fields.get(2)?.clone()).ok()?;
            let args = redis::from_redis_value::<Vec<String>>(fields.get(3)?.clone()).ok()?;
            (args.first().map(String::as_str) == Some("EVALSHA")).then_some(micros)
        })
        .collect();
    let stats = redis
        .info_field("commandstats", "cmdstat_evalsha")
        .unwrap_or_default();
    let mut cpu: Vec<u64> = costs.iter().map(|(cpu, _, _)| *cpu).collect();
    cpu.sort_unstable();
    let slow_trips: Vec<&(u64, u64, Duration)> = costs
        .iter()
        .filter(|(_, _, trip)| *trip > Duration::from_millis(5))
        .collect();
    let us = |ns: u64| ns / 1_000;
    println!(
        "[delete_prefix] {jobs} jobs: one user's {one_user} in {one_steps} steps ({one_took:?}), \
         the other {everyone} in {all_steps} steps ({all_took:?}); Redis CPU per step (us): mean \
         {}, p50 {}, p99 {}, p99.9 {}, max {}; SLOWLOG (wall): EVALSHA {stats}; steps over 1 ms: \
         {}, over 5 ms: {}, slowest {:?} us; round trips over 5 ms: {}, their Redis CPU max {} \
         us, run-queue wait max {} us; load average {}",
        us(cpu.iter().sum::<u64>() / cpu.len().max(1) as u64),
        us(percentile(&cpu, 0.50)),
        us(percentile(&cpu, 0.99)),
        us(percentile(&cpu, 0.999)),
        us(cpu.last().copied().unwrap_or(0)),
        slow.len(),
        slow.iter().filter(|&&us| us > 5_000).count(),
        slow.iter().max(),
        slow_trips.len(),
        us(slow_trips.iter().map(|(cpu, _, _)| *cpu).max().unwrap_or(0)),
        us(slow_trips
            .iter()
            .map(|(_, wait, _)| *wait)
            .max()
            .unwrap_or(0)),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let over: Vec<u64> = cpu
        .iter()
        .filter(|&&ns| ns > STEP_CPU_BOUND_NS)
        .map(|&ns| us(ns))
        .collect();
    assert!(
        over.is_empty(),
        "{} of {} steps used over 5 ms of Redis CPU (us): {over:?}",
        over.len(),
        cpu.len()
    );
}

/// The AMQP op: `x-redisched-op: delete-prefix`, `message_id` = the prefix. It applies in
/// command order (a put before it goes, a put after it stays), answers how many went on
/// `reply_to`, and a too-short prefix is set aside with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_amqp_op_applies_in_command_order_and_answers_the_count() {
    let _shared = common::timed::shared().await;
    use common::bridge::*;
    use lapin::types::AMQPValue;

    let config = test_config("prefixop");
    let broker = Broker::new(&config).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let replies = common::unique("replies");
    broker.declare_queue(&replies).await;
    let mut answers = broker.consume_queue(&replies).await;
    let mut invalid = broker.consume_invalid().await;
    let far = [("x-delay", AMQPValue::LongLongInt(3_600_000))];
    // Published while no bridge runs, so one bridge gets them all in one window: the
    // delete-prefix must still split it and apply in order.
    for id in [
        "acct_42_welcome",
        "acct_42_digest",
        "acct_420_welcome",
        "acct_7_welcome",
    ] {
        broker.put("mail", id, b"x", &far).await;
    }
    let op = |prefix: &str| {
        props(prefix, &[("x-redisched-op", text("delete-prefix"))])
            .with_reply_to(replies.as_str().into())
            .with_correlation_id(prefix.into())
    };
    broker.command("mail", op("acct_42_"), b"").await;
    broker.put("mail", "acct_42_after", b"x", &far).await;
    broker.command("mail", op("ac"), b"").await;

    let bridge = InProcess::start(&config);
    let mut got = Vec::new();
    for _ in 0..2 {
        let (_, reply) = answers
            .next(Duration::from_secs(20))
            .await
            .expect("a reply for each delete-prefix");
        let body: serde_json::Value = serde_json::from_slice(&reply.data).unwrap();
        got.push(body);
    }
    assert_eq!(got[0]["status"], "deleted", "{got:?}");
    assert_eq!(got[0]["deleted"], 2, "{got:?}");
    assert_eq!(got[0]["id"], "acct_42_");
    assert_eq!(got[1]["status"], "invalid", "{got:?}");
    assert!(
        got[1]["error"]
            .as_str()
            .unwrap_or("")
            .contains("shorter than 3"),
        "{got:?}"
    );
    let (_, aside) = invalid
        .next(Duration::from_secs(10))
        .await
        .expect("the short prefix set aside");
    assert_eq!(message_id(&aside), "ac");
    assert!(header_text(&aside, "x-redisched-error")
        .unwrap_or_default()
        .contains("shorter than 3"));

    let mail = Topic::new("mail").unwrap();
    let left = ids(
        &store,
        &mail,
        &[
            "acct_42_welcome",
            "acct_42_digest",
            "acct_420_welcome",
            "acct_7_welcome",
            "acct_42_after",
        ],
    )
    .await;
    assert_eq!(
        left,
        ["acct_420_welcome", "acct_7_welcome", "acct_42_after"]
    );
    let history = store.history(&mail, None, 50).await.unwrap();
    assert_eq!(
        history
            .iter()
            .filter(|e| e.detail == "prefix acct_42_")
            .count(),
        2
    );
    bridge.stop().await;
    broker.cleanup().await;
}

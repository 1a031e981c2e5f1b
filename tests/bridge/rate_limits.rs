//! Per-topic rate limits, enforced in the store so that they hold for the sum of all
//! bridges: the scripts driven straight through EVALSHA (as any client would), the
//! typed store API with the configuration's policies, and three real bridges draining
//! a limited backlog beside an unlimited topic while the limit changes live and a
//! bridge is SIGKILLed.
//!
//! The bridge case runs 20 s by default; `RATE_LIMIT_TEST_SECONDS=60` (and
//! `RATE_LIMIT_TEST_JOBS=20000`) runs the full acceptance.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use common::bridge::*;
use redis::Value;
use redisched::job::{Due, Topic};
use redisched::policy::{Policies, Policy, RateLimit, TopicPattern};
use redisched::store::{Op, RateSource};
use redisched_testkit::percentile;

// ------------------------------------------------------------------ scripts, raw

struct RawTopic {
    prefix: String,
    name: String,
    conn: redis::Connection,
}

impl Drop for RawTopic {
    fn drop(&mut self) {
        common::delete_prefix(&self.prefix);
    }
}

impl RawTopic {
    fn new() -> Self {
        Self {
            prefix: common::unique("rate"),
            name: "limited".into(),
            conn: common::raw_redis(),
        }
    }

    /// The full key list plus the ninth, `rate`.
    fn keys(&self, count: usize) -> Vec<String> {
        let names = common::FULL_KEY_NAMES.into_iter().chain(["rate"]);
        common::topic_keys(&self.prefix, &self.name, names.take(count))
    }

    fn eval(&mut self, source: &str, keys: usize, args: &[&str]) -> redis::RedisResult<Value> {
        let script = redis::Script::new(source);
        let mut inv = script.prepare_invoke();
        for key in self.keys(keys) {
            inv.key(key);
        }
        for arg in args {
            inv.arg(*arg);
        }
        inv.invoke::<Value>(&mut self.conn)
    }

    fn put_due(&mut self, count: usize) {
        for i in 0..count {
            // Due times 1 ms apart in the past, so the order is known.
            let at = (1_000_000 + i).to_string();
            let id = format!("job-{i:03}");
            self.eval(
                include_str!("../../lua/put.lua"),
                8,
                &[&id, "b", "", "nx", "at", &at, "31622400000", "1048576", ""],
            )
            .expect("put");
        }
    }

    /// `(now, ids taken, throttled, next_token)` of a reserve with the ninth key.
    fn reserve(&mut self, limit: usize, default: &[&str]) -> (i64, Vec<String>, i64, i64) {
        let limit = limit.to_string();
        let mut args = vec!["30000", limit.as_str(), ""];
        args.extend_from_slice(default);
        let reply = self
            .eval(include_str!("../../lua/reserve.lua"), 9, &args)
            .expect("reserve");
        let Value::Array(items) = reply else {
            panic!("reserve reply {reply:?}")
        };
        assert_eq!(items.len(), 7, "the nine-key reply has seven fields");
        (
            int(&items[0]),
            ids(&items[2]),
            int(&items[5]),
            int(&items[6]),
        )
    }

    fn rate_limit(&mut self, args: &[&str]) -> redis::RedisResult<Value> {
        self.eval(include_str!("../../lua/rate_limit.lua"), 9, args)
    }
}

fn int(value: &Value) -> i64 {
    match value {
        Value::Int(n) => *n,
        other => panic!("expected an integer, got {other:?}"),
    }
}

fn text(value: &Value) -> String {
    match value {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        other => panic!("expected a string, got {other:?}"),
    }
}

fn ids(value: &Value) -> Vec<String> {
    let Value::Array(jobs) = value else {
        panic!("jobs {value:?}")
    };
    jobs.iter()
        .map(|job| match job {
            Value::Array(fields) => text(&fields[0]),
            other => panic!("job {other:?}"),
        })
        .collect()
}

#[test]
fn a_live_limit_holds_due_jobs_back_in_order_and_says_when_the_next_token_comes() {
    let _shared = common::timed::shared_blocking();
    let mut t = RawTopic::new();
    t.put_due(10);
    assert_eq!(int(&t.rate_limit(&["set", "0.5", "2"]).unwrap()), 1);

    // A full bucket: the burst goes at once, earliest first; the rest is held back.
    let (now, taken, throttled, next_token) = t.reserve(5, &[]);
    assert_eq!(taken, ["job-000", "job-001"]);
    assert_eq!(throttled, 8);
    // Two jobs taken at 0.5/s with room for 2: one token again 2 s after now.
    assert!(
        (now + 1_999..=now + 2_001).contains(&next_token),
        "{next_token} - {now}"
    );
    let (_, taken, throttled, again) = t.reserve(5, &[]);
    assert!(taken.is_empty(), "no token left: {taken:?}");
    assert_eq!((throttled, again), (8, next_token));

    // The same state read by rate_limit.lua get.
    let Value::Array(state) = t.rate_limit(&["get", "", ""]).unwrap() else {
        panic!()
    };
    assert_eq!(
        (text(&state[1]), int(&state[2]), text(&state[3])),
        ("0.5".into(), 2, "live".into())
    );
    assert_eq!((int(&state[4]), int(&state[5])), (8, next_token));

    // Clients of the previous releases (eight or four keys) do not see the limit.
    let reply = t
        .eval(include_str!("../../lua/reserve.lua"), 8, &["30000", "3"])
        .unwrap();
    let Value::Array(items) = reply else { panic!() };
    assert_eq!(items.len(), 5, "the eight-key reply keeps its shape");
    assert_eq!(ids(&items[2]), ["job-002", "job-003", "job-004"]);
    let reply = t
        .eval(include_str!("../../lua/reserve.lua"), 4, &["30000", "1"])
        .unwrap();
    let Value::Array(items) = reply else { panic!() };
    assert_eq!(items.len(), 4);
    assert_eq!(ids(&items[2]), ["job-005"]);
}

#[test]
fn a_fractional_rate_lets_one_job_go_every_two_seconds() {
    let _shared = common::timed::shared_blocking();
    let mut t = RawTopic::new();
    t.put_due(3);
    t.rate_limit(&["set", "0.5", "1"]).unwrap();
    let (now, taken, _, next_token) = t.reserve(10, &[]);
    assert_eq!(taken, ["job-000"]);
    assert!((now + 1_999..=now + 2_001).contains(&next_token));
    // Just before the token: nothing; at it: exactly one.
    std::thread::sleep(Duration::from_millis(
        u64::try_from(next_token - now - 150).unwrap(),
    ));
    let (_, taken, throttled, _) = t.reserve(10, &[]);
    assert!(taken.is_empty() && throttled == 2, "{taken:?} {throttled}");
    std::thread::sleep(Duration::from_millis(200));
    let (now2, taken, throttled, next2) = t.reserve(10, &[]);
    assert_eq!(taken, ["job-001"], "at {} ms", now2 - now);
    assert_eq!(throttled, 1);
    assert!(
        (now2 + 1_999..=now2 + 2_001).contains(&next2),
        "{next2} - {now2}"
    );
}

#[test]
fn the_callers_default_applies_without_a_live_limit_and_the_live_one_overrides_it() {
    let _shared = common::timed::shared_blocking();
    let mut t = RawTopic::new();
    t.put_due(20);
    // No live limit, a default (a policy) of 100/s with a burst of 3.
    let (_, taken, throttled, _) = t.reserve(10, &["100", "3"]);
    assert_eq!((taken.len(), throttled), (3, 17));
    // State alone expires by itself (it equals a full bucket once past).
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&t.keys(9)[8])
        .query(&mut t.conn)
        .unwrap();
    assert!((1..=2_100).contains(&ttl), "pttl {ttl}");

    // A live limit overrides it: a burst of 1 at 1/s, so nothing now (the bucket's
    // state is kept across the change, no fresh burst) ...
    t.rate_limit(&["set", "1", "1"]).unwrap();
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&t.keys(9)[8])
        .query(&mut t.conn)
        .unwrap();
    assert_eq!(ttl, -1, "a live limit never expires");
    let (_, taken, _, _) = t.reserve(10, &["100", "3"]);
    assert!(taken.is_empty(), "{taken:?}");
    // ... and removing it returns to the default.
    assert_eq!(int(&t.rate_limit(&["delete"]).unwrap()), 1);
    assert_eq!(int(&t.rate_limit(&["delete"]).unwrap()), 0);
    std::thread::sleep(Duration::from_millis(40));
    let (_, taken, _, _) = t.reserve(10, &["100", "3"]);
    assert_eq!(taken.len(), 3, "the default's burst is back after 30 ms");

    // Without any limit: nothing held back, next_token -1.
    let (_, taken, throttled, next_token) = t.reserve(5, &[]);
    assert_eq!((taken.len(), throttled, next_token), (5, 0, -1));
}

#[test]
fn bad_limits_are_refused_with_a_reason_and_change_nothing() {
    let _shared = common::timed::shared_blocking();
    let mut t = RawTopic::new();
    t.rate_limit(&["set", "20", "5"]).unwrap();
    for (rate, burst, needle) in [
        ("0", "5", "max_per_second"),
        ("-1", "5", "max_per_second"),
        ("abc", "5", "max_per_second"),
        ("nan", "5", "max_per_second"),
        ("inf", "5", "max_per_second"),
        ("1e9", "5", "max_per_second"),
        ("10000000", "5", "max_per_second"),
        ("20", "0", "burst"),
        ("20", "1.5", "burst"),
        ("20", "-3", "burst"),
        ("20", "", "burst"),
    ] {
        let err = t
            .rate_limit(&["set", rate, burst])
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains("INVALID_ARGUMENT") && err.contains(needle),
            "{rate} {burst}: {err}"
        );
    }
    let Value::Array(state) = t.rate_limit(&["get", "", ""]).unwrap() else {
        panic!()
    };
    assert_eq!((text(&state[1]), int(&state[2])), ("20".into(), 5));
    let err = t
        .rate_limit(&["frobnicate"])
        .expect_err("bad op")
        .to_string();
    assert!(err.contains("op must be get, set or delete"), "{err}");
    let err = t
        .eval(
            include_str!("../../lua/rate_limit.lua"),
            8,
            &["get", "", ""],
        )
        .expect_err("eight keys")
        .to_string();
    assert!(err.contains("9 keys"), "{err}");
    // A default is only read when no live limit is stored.
    t.rate_limit(&["delete"]).unwrap();
    let err = t
        .eval(
            include_str!("../../lua/reserve.lua"),
            9,
            &["30000", "5", "", "0", "1"],
        )
        .expect_err("a zero default")
        .to_string();
    assert!(err.contains("max_per_second"), "{err}");
}

// ------------------------------------------------------------------ the typed store

#[tokio::test]
async fn the_store_applies_policies_by_topic_pattern_and_reports_throttled_jobs() {
    let _shared = common::timed::shared().await;
    let test = common::test_store().await;
    let policies = Policies(vec![Policy {
        topics: vec![TopicPattern::new("bulk.#").unwrap()],
        rate: Some(RateLimit::new(10.0, Some(4.0)).unwrap()),
        expires_after_ms: 0,
    }]);
    let store = test.store.clone().with_policies(policies);
    let limited = Topic::new("bulk.mail").unwrap();
    let free = Topic::new("mail").unwrap();
    let ops: Vec<Op> = (0..10)
        .flat_map(|i| {
            [
                common::put_op("bulk.mail", &format!("b{i}"), Due::NOW),
                common::put_op("mail", &format!("m{i}"), Due::NOW),
            ]
        })
        .collect();
    store.apply(&ops).await.unwrap();

    let ttr = Duration::from_secs(30);
    let batch = store.reserve(&limited, ttr, 100).await.unwrap();
    assert_eq!((batch.jobs.len(), batch.throttled), (4, 6));
    let token = batch.next_token.expect("a limit applies");
    assert!((batch.now + 99..=batch.now + 101).contains(&token));
    let batch = store.reserve(&free, ttr, 100).await.unwrap();
    assert_eq!(
        (batch.jobs.len(), batch.throttled, batch.next_token),
        (10, 0, None)
    );

    let stats = store.stats(&limited).await.unwrap();
    assert_eq!((stats.due_now, stats.throttled), (6, 6));
    let state = store.rate_state(&limited).await.unwrap();
    let (limit, source) = state.limit.expect("the policy's");
    assert_eq!(
        (limit.max_per_second, limit.burst, source),
        (10.0, 4, RateSource::Policy)
    );
    assert_eq!(store.stats(&free).await.unwrap().throttled, 0);

    // A live limit overrides the policy; deleting it returns to the policy.
    store
        .set_rate_limit(&limited, RateLimit::new(0.5, None).unwrap())
        .await
        .unwrap();
    let (limit, source) = store.rate_state(&limited).await.unwrap().limit.unwrap();
    assert_eq!(
        (limit.max_per_second, limit.burst, source),
        (0.5, 1, RateSource::Live)
    );
    assert!(store.delete_rate_limit(&limited).await.unwrap());
    assert!(!store.delete_rate_limit(&limited).await.unwrap());
    let (_, source) = store.rate_state(&limited).await.unwrap().limit.unwrap();
    assert_eq!(source, RateSource::Policy);
    assert_eq!(test.store.rate_state(&free).await.unwrap().limit, None);
}

// ------------------------------------------------------------------ three bridges

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The most arrivals in any window `[t, t + 1 s)` that starts at an arrival in
/// `[from, to)`, and where it starts (ms after `from`).
fn busiest_second(arrivals: &[i64], from: i64, to: i64) -> (usize, i64) {
    let mut best = (0, 0);
    for (i, &start) in arrivals.iter().enumerate() {
        if start < from || start >= to {
            continue;
        }
        let end = arrivals[i..].partition_point(|&t| t < start + 1_000);
        if end > best.0 {
            best = (end, start - from);
        }
    }
    best
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: bash scripts/test.sh runs it"]
async fn three_bridges_share_one_limit_beside_an_unlimited_topic_through_a_change_and_a_kill() {
    let _alone = common::timed::alone().await;
    let seconds = env_number("RATE_LIMIT_TEST_SECONDS", 20) as i64;
    let backlog = env_number("RATE_LIMIT_TEST_JOBS", 5_000) as usize;
    const BURST: usize = 20;
    let mut config = test_config("rate3");
    config.dispatch.ttr_ms = 1_000;
    let store = common::test_store_named(&config.redis.prefix).await;
    let limited = Topic::new("bulk").unwrap();
    store
        .set_rate_limit(&limited, RateLimit::new(200.0, Some(BURST as f64)).unwrap())
        .await
        .unwrap();
    for chunk in (0..backlog).collect::<Vec<_>>().chunks(1000) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|i| common::put_op("bulk", &format!("b{i}"), Due::NOW))
            .collect();
        store.apply(&ops).await.expect("load the backlog");
    }
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready_stamped("#").await;
    let mut bridges: Vec<ChildBridge> = (0..3).map(|_| ChildBridge::start(&config)).collect();

    // The unlimited topic: 500 jobs/s, each due 200 ms after its put.
    let producer_store = store.clone();
    let stop_producing = tokio_util::sync::CancellationToken::new();
    let stop = stop_producing.clone();
    let producer = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        let mut n = 0usize;
        while !stop.is_cancelled() {
            tick.tick().await;
            let ops: Vec<Op> = (n..n + 5)
                .map(|i| common::put_op("live", &format!("l{i}"), Due::Delay(200)))
                .collect();
            n += 5;
            producer_store.apply(&ops).await.expect("put live jobs");
        }
        n
    });

    let start = now_ms();
    let kill_at = start + seconds * 1_000 / 3;
    let change_at = start + seconds * 2_000 / 3;
    let end = start + seconds * 1_000;
    let (mut killed, mut changed) = (false, None);
    let mut bulk: Vec<(i64, String)> = Vec::new();
    // (arrival, due, id, attempt): attempt 2 is a job the killed bridge held, back after
    // its reservation expired.
    let mut live: Vec<(i64, i64, String, i64)> = Vec::new();
    while now_ms() < end {
        if !killed && now_ms() >= kill_at {
            bridges[0].kill9();
            killed = true;
        }
        if changed.is_none() && now_ms() >= change_at {
            store
                .set_rate_limit(&limited, RateLimit::new(50.0, Some(BURST as f64)).unwrap())
                .await
                .unwrap();
            changed = Some(now_ms());
        }
        if let Ok(Some((at, d))) =
            tokio::time::timeout(Duration::from_millis(20), ready.recv()).await
        {
            match d.routing_key.as_str() {
                "bulk" => bulk.push((at, message_id(&d))),
                _ => live.push((
                    at,
                    header_i64(&d, "x-redisched-due-at").expect("due-at"),
                    message_id(&d),
                    header_i64(&d, "x-redisched-attempt").expect("attempt"),
                )),
            }
        }
    }
    stop_producing.cancel();
    let produced = producer.await.unwrap();
    // The live topic's stragglers (the killed bridge's reservations come back after the
    // 1 s TTR), and what the bulk topic still delivers meanwhile.
    let drain_until = now_ms() + 4_000;
    while now_ms() < drain_until {
        if let Ok(Some((at, d))) =
            tokio::time::timeout(Duration::from_millis(100), ready.recv()).await
        {
            match d.routing_key.as_str() {
                "bulk" => bulk.push((at, message_id(&d))),
                _ => live.push((at, 0, message_id(&d), 0)),
            }
        }
    }
    for bridge in bridges.iter_mut().skip(1) {
        let (status, _) = bridge.terminate();
        assert!(status.success(), "SIGTERM exits 0");
    }
    // What the bridges confirmed while stopping (released from the store) is in the
    // consumer's queue: count it too.
    while let Ok(Some((at, d))) =
        tokio::time::timeout(Duration::from_millis(500), ready.recv()).await
    {
        match d.routing_key.as_str() {
            "bulk" => bulk.push((at, message_id(&d))),
            _ => live.push((at, 0, message_id(&d), 0)),
        }
    }
    let changed = changed.expect("the limit was changed");

    // Rates of the bulk topic, in the two phases.
    let arrivals: Vec<i64> = bulk.iter().map(|(at, _)| *at).collect();
    let first = *arrivals.first().expect("bulk deliveries");
    let (busiest_200, busiest_200_at) = busiest_second(&arrivals, first, changed - 1_000);
    // Once the opening burst is spent: the steady state.
    let (busiest_steady, _) = busiest_second(&arrivals, first + 1_000, changed - 1_000);
    let (busiest_50, _) = busiest_second(&arrivals, changed + 1_000, end - 1_000);
    let count_in = |from: i64, to: i64| arrivals.iter().filter(|&&t| t >= from && t < to).count();
    let steady = (first + 1_000, changed);
    let rate_200 = count_in(steady.0, steady.1) as f64 * 1_000.0 / (steady.1 - steady.0) as f64;
    let slow = (changed + 1_000, end);
    let rate_50 = count_in(slow.0, slow.1) as f64 * 1_000.0 / (slow.1 - slow.0) as f64;

    // The unlimited topic's lateness, of first attempts: a job the killed bridge had
    // reserved comes back, by contract, only once its reservation expired (TTR), and
    // is judged by that bound instead.
    let mut lateness: Vec<i64> = live
        .iter()
        .filter(|(_, due, _, attempt)| *due > 0 && *attempt == 1)
        .map(|(at, due, _, _)| at - due)
        .collect();
    let requeued: Vec<i64> = live
        .iter()
        .filter(|(_, due, _, attempt)| *due > 0 && *attempt > 1)
        .map(|(at, due, _, _)| at - due)
        .collect();
    let requeued_max = requeued.iter().copied().max().unwrap_or(0);
    // When the latest first attempt was due, from the start: a stall names its moment.
    let worst_at = live
        .iter()
        .filter(|(_, due, _, attempt)| *due > 0 && *attempt == 1)
        .max_by_key(|(at, due, _, _)| at - due)
        .map_or(0, |(_, due, _, _)| due - start);
    lateness.sort_unstable();
    let p50 = percentile(&lateness, 0.50);
    let p99 = percentile(&lateness, 0.99);
    let early = lateness.iter().filter(|&&l| l < 0).count();

    // Nothing lost: every bulk job was delivered or is still in the store; every live
    // job was delivered.
    let delivered: HashSet<&str> = bulk.iter().map(|(_, id)| id.as_str()).collect();
    let stats = store.stats(&limited).await.unwrap();
    let live_ids: HashSet<&str> = live.iter().map(|(_, _, id, _)| id.as_str()).collect();
    eprintln!(
        "rate limits, {seconds} s, {backlog} jobs, 3 bridges (one SIGKILLed at {} s, limit 200 -> 50/s at {} s): \
         bulk delivered {} ({} distinct), mean {rate_200:.1}/s at 200 (busiest 1-s window {busiest_200}, {busiest_200_at} ms after the first delivery; \
         {busiest_steady} after the first second), \
         {rate_50:.1}/s at 50 (busiest {busiest_50}); left in the store {}; \
         live topic {} of {produced} delivered, first attempts' lateness p50 {p50} ms, p99 {p99} ms, max {} ms (due at +{worst_at} ms), {early} early; \
         {} requeued after the kill, at most {requeued_max} ms late",
        (kill_at - start) / 1000,
        (changed - start) / 1000,
        bulk.len(),
        delivered.len(),
        stats.records,
        live_ids.len(),
        lateness.last().copied().unwrap_or(0),
        requeued.len(),
    );
    // The store takes at most burst + 200 in any second (the opening one: the burst at
    // once, then a token every 5 ms; the scripts' own tests check that exactly). Windows
    // are measured on arrival at the consumer: a window that opens with a slow first
    // arrival also takes the tokens reserved that much after its last store second. So the
    // opening window gets the jobs that the path's own delay spread in this run (the
    // unlimited topic's p99 lateness beside it) can shift in at 200/s, plus 2; 219..=228
    // were seen there. A later window gets the same allowance: the bucket refills to its
    // burst whenever reserving pauses (the SIGKILL, a stalled machine), and what arrives
    // after such a pause is spread by the same path (one red run at load ~1.3 had a
    // window over 220 after the opening; 202..=218 were seen otherwise).
    // Where the path itself stalled around the busiest window (its unlimited jobs were
    // that late there: one red run had a 288-ms stall at the opening, p99 101 ms), the
    // window takes what that stall held back, so its allowance is the path's worst delay
    // around it; no better than p99 anywhere.
    let jitter_of = |delay_ms: i64| usize::try_from(delay_ms.max(0) * 200 / 1000).unwrap_or(0) + 2;
    let jitter = jitter_of(p99);
    let busiest_starts = first + busiest_200_at;
    let stall_there = live
        .iter()
        .filter(|(at, due, _, attempt)| {
            *due > 0
                && *attempt == 1
                && (busiest_starts - 1_000..busiest_starts + 2_000).contains(at)
        })
        .map(|(at, due, _, _)| at - due)
        .max()
        .unwrap_or(0)
        .max(p99);
    let jitter_there = jitter_of(stall_there);
    assert!(
        busiest_200 <= 200 + BURST + jitter_there,
        "a 1-s window delivered {busiest_200} > 200 + burst + {jitter_there} of arrival jitter (the path's worst delay around that window {stall_there} ms at 200/s, + 2)"
    );
    assert!(
        busiest_steady <= 200 + BURST + jitter,
        "a 1-s window after the opening burst delivered {busiest_steady} > 200 + burst + {jitter} of arrival jitter"
    );
    assert!(
        (196.0..=204.0).contains(&rate_200),
        "mean rate {rate_200:.1}/s, not 200 ± 2 %"
    );
    assert!(
        busiest_50 <= 50 + BURST,
        "a 1-s window from 1 s after the change delivered {busiest_50} > 50 + burst"
    );
    assert!(
        (47.5..=52.5).contains(&rate_50),
        "mean rate after the change {rate_50:.1}/s, not 50 ± 5 %"
    );
    let jobs_key = format!("{}:{{bulk}}:jobs", config.redis.prefix);
    let kept: HashSet<String> = redis::cmd("HKEYS")
        .arg(&jobs_key)
        .query(&mut common::raw_redis())
        .unwrap();
    let lost: Vec<String> = (0..backlog)
        .map(|i| format!("b{i}"))
        .filter(|id| !delivered.contains(id.as_str()) && !kept.contains(id))
        .collect();
    assert!(
        lost.is_empty(),
        "bulk jobs neither delivered nor kept: {lost:?}"
    );
    assert_eq!(live_ids.len(), produced, "every live job delivered");
    assert_eq!(early, 0, "no live job early");
    assert!(p99 <= 50, "live topic p99 lateness {p99} ms > 50 ms");
    // The sweep that requeues them runs every requeue interval (1 s by default).
    let requeue_bound =
        config.dispatch.ttr_ms as i64 + config.dispatch.requeue_interval_ms as i64 + 500;
    assert!(
        requeued_max <= requeue_bound,
        "a job the killed bridge held came back {requeued_max} ms late > TTR + requeue interval + 500 ms"
    );
    broker.cleanup().await;
}

// ------------------------------------------------------------------ the faces

/// The HTTP API on a store of its own prefix.
async fn http_server(prefix: &str) -> (String, tokio_util::sync::CancellationToken) {
    use redisched::http::{self, AppState};
    use std::sync::Arc;
    let state = AppState {
        store: common::test_store_named(prefix).await,
        metrics: Arc::new(redisched::metrics::Metrics::new()),
        feed: redisched::feed::Feed::new(),
        config: Arc::new(redisched::config::Config::default()),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(http::serve(state, listener, shutdown.clone()));
    (base, shutdown)
}

#[tokio::test]
async fn the_rest_api_sets_shows_and_removes_a_live_limit_and_refuses_bad_ones() {
    let _shared = common::timed::shared().await;
    let test = common::test_store().await;
    let ops: Vec<Op> = (0..30)
        .map(|i| common::put_op("mail", &format!("m{i}"), Due::NOW))
        .collect();
    test.apply(&ops).await.unwrap();
    let (base, shutdown) = http_server(&test.prefix).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/topics/mail/rate-limit");

    let res = client
        .put(&url)
        .json(&serde_json::json!({"max_per_second": 20, "burst": 5}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let body: serde_json::Value = res.json().await.unwrap();
    assert_eq!(
        body,
        serde_json::json!({"topic": "mail", "changed": true, "throttled": 25,
            "rate_limit": {"max_per_second": 20.0, "burst": 5, "source": "live"}})
    );
    // Every bridge reads it from Redis: a reserve through another store obeys it.
    let batch = test
        .reserve(&Topic::new("mail").unwrap(), Duration::from_secs(30), 100)
        .await
        .unwrap();
    assert_eq!((batch.jobs.len(), batch.throttled), (5, 25));

    for (body, needle) in [
        (r#"{"max_per_second": 0}"#, "pause"),
        (r#"{"max_per_second": -5}"#, "> 0"),
        (r#"{"max_per_second": "fast"}"#, "JSON number"),
        (r#"{"max_per_second": 1e300}"#, "0.001..="),
        (r#"{"max_per_second": 5, "burst": 1.5}"#, "burst"),
        (r#"{"max_per_second": 5, "burst": 0}"#, "burst"),
        ("NaN", "JSON"),
    ] {
        let res = client
            .put(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 400, "{body}");
        let error: serde_json::Value = res.json().await.unwrap();
        assert!(
            error["error"].as_str().unwrap_or("").contains(needle),
            "{body}: {error}"
        );
    }
    // Nothing changed by the refusals.
    let topics: serde_json::Value = client
        .get(format!("{base}/v1/topics"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let row = &topics["topics"][0];
    assert_eq!(row["throttled"], 25, "{row}");
    assert_eq!(row["rate_limit"]["max_per_second"], 20.0, "{row}");
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("redisched_jobs_throttled{topic=\"mail\"} 25\n"),
        "{metrics}"
    );

    let res = client.delete(&url).send().await.unwrap();
    let body: serde_json::Value = res.json().await.unwrap();
    assert_eq!(body["changed"], true);
    assert_eq!(body["rate_limit"], serde_json::Value::Null);
    assert_eq!(body["throttled"], 0);
    let body: serde_json::Value = client
        .delete(&url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["changed"], false);
    shutdown.cancel();
}

#[tokio::test]
async fn the_cli_sets_and_removes_a_limit_over_a_policy_of_its_config_file() {
    let _shared = common::timed::shared().await;
    use clap::Parser;
    let test = common::test_store().await;
    let config = std::env::temp_dir().join(format!("{}.toml", common::unique("rate-cli")));
    std::fs::write(
        &config,
        format!(
            "[redis]\nurl = {:?}\nprefix = {:?}\n\n[[policies]]\ntopics = [\"mail.#\"]\nmax_per_second = 2\nburst = 3\n",
            common::redis_url(),
            test.prefix
        ),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let config = config.to_string_lossy().into_owned();
        let argv: Vec<String> = ["redisched", "--config", config.as_str()]
            .iter()
            .chain(args)
            .map(|s| s.to_string())
            .collect();
        async move {
            let cli = redisched::cli::Cli::try_parse_from(argv).expect("parses");
            redisched::cli::execute(&cli)
                .await
                .map(|out| out.render(cli.json))
                .map_err(|e| (e.exit_code(), e.to_string()))
        }
    };
    let shown = run(&["rate-limit", "mail.welcome"]).await.unwrap();
    assert!(
        shown.contains("limited to 2/s, burst 3 (the configuration's [[policies]])"),
        "{shown}"
    );
    let set = run(&[
        "--json",
        "rate-limit",
        "mail.welcome",
        "0.5/s",
        "--burst",
        "2",
    ])
    .await
    .unwrap();
    let set: serde_json::Value = serde_json::from_str(&set).unwrap();
    assert_eq!(
        set["rate_limit"],
        serde_json::json!({"max_per_second": 0.5, "burst": 2, "source": "live"})
    );
    for (args, needle) in [
        (&["rate-limit", "mail.welcome", "0/s"][..], "pause"),
        (&["rate-limit", "mail.welcome", "-1/s"], "> 0"),
        (&["rate-limit", "mail.welcome", "fast"], "<n>/s"),
        (
            &["rate-limit", "mail.welcome", "5/s", "--burst", "1.5"],
            "burst",
        ),
        (
            &["rate-limit", "mail.welcome", "--burst", "2"],
            "needs a rate",
        ),
    ] {
        let (code, message) = run(args).await.expect_err("refused");
        assert!(
            code == 2 && message.contains(needle),
            "{args:?}: {code} {message}"
        );
    }
    let stats = run(&["stats", "mail.welcome"]).await.unwrap();
    assert!(stats.contains("0.5/s, burst 2"), "{stats}");
    let off = run(&["rate-limit", "mail.welcome", "off"]).await.unwrap();
    assert!(off.contains("(the configuration's [[policies]])"), "{off}");
    let _ = std::fs::remove_file(&config);
}

// ------------------------------------------------------------------ cost on the unlimited path

/// Reserve+release throughput with no limit set, the previous `reserve.lua` (eight keys)
/// against this one (nine keys, no limit stored), in alternating pairs on a private
/// redis-server, so that its `INFO commandstats` (server time per script call) are this
/// measurement's alone. Run by hand:
/// `git show <base>:lua/reserve.lua > /tmp/reserve-old.lua; RATE_BENCH_OLD_RESERVE=/tmp/reserve-old.lua
/// cargo test --test bridge rate_limits::unlimited_path_cost -- --ignored --nocapture`
#[test]
#[ignore = "a measurement, run by hand (see its docs)"]
fn unlimited_path_cost() {
    let old_path = std::env::var("RATE_BENCH_OLD_RESERVE")
        .expect("RATE_BENCH_OLD_RESERVE = the previous release's lua/reserve.lua");
    let old_reserve = std::fs::read_to_string(old_path).expect("read the old reserve.lua");
    let jobs = env_number("RATE_BENCH_JOBS", 50_000) as usize;
    let pairs = env_number("RATE_BENCH_PAIRS", 5) as usize;
    let server = common::faults::PrivateRedis::start();
    let mut conn = server.connection();
    // Server time of the scripts alone: the AOF the fault tests keep is off here.
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("appendonly")
        .arg("no")
        .exec(&mut conn)
        .unwrap();
    let put = redis::Script::new(include_str!("../../lua/put.lua"));
    let release = redis::Script::new(include_str!("../../lua/release.lua"));
    let new_reserve = redis::Script::new(include_str!("../../lua/reserve.lua"));
    let old_reserve = redis::Script::new(&old_reserve);
    let keys = common::topic_keys(
        "bench",
        "t",
        common::FULL_KEY_NAMES.into_iter().chain(["rate"]),
    );
    for script in [&put, &release, &new_reserve, &old_reserve] {
        script.prepare_invoke().load(&mut conn).unwrap();
    }
    let evalsha = |script: &redis::Script, nkeys: usize, args: &[String]| {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(nkeys)
            .arg(&keys[..nkeys])
            .arg(args);
        cmd
    };
    // One run: load `jobs` due jobs, then reserve 100 + release them until none is left;
    // (jobs per second of wall time, µs of server time per reserve+release pair).
    let mut run = |script: &redis::Script, nkeys: usize| -> (f64, f64) {
        redis::cmd("FLUSHALL").exec(&mut conn).unwrap();
        for chunk in (0..jobs).collect::<Vec<_>>().chunks(1000) {
            let mut pipe = redis::pipe();
            for i in chunk {
                pipe.add_command(evalsha(
                    &put,
                    8,
                    &[
                        format!("j{i}"),
                        "body".into(),
                        "".into(),
                        "nx".into(),
                        "delay".into(),
                        "0".into(),
                        "31622400000".into(),
                        "1048576".into(),
                        "".into(),
                        "".into(),
                        "0".into(),
                    ],
                ))
                .ignore();
            }
            pipe.exec(&mut conn).unwrap();
        }
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .exec(&mut conn)
            .unwrap();
        let start = std::time::Instant::now();
        let mut calls = 0u64;
        loop {
            let reply: Value = evalsha(script, nkeys, &["30000".into(), "100".into()])
                .query(&mut conn)
                .unwrap();
            let Value::Array(items) = reply else { panic!() };
            let Value::Array(taken) = &items[2] else {
                panic!()
            };
            if taken.is_empty() {
                break;
            }
            let mut args = Vec::with_capacity(taken.len() * 2 + 1);
            for job in taken {
                let Value::Array(fields) = job else { panic!() };
                args.push(text(&fields[0]));
                args.push(int(&fields[3]).to_string());
            }
            args.push("0".into());
            let _: i64 = evalsha(&release, 8, &args).query(&mut conn).unwrap();
            calls += 1;
        }
        let wall = start.elapsed();
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut conn)
            .unwrap();
        let usec: f64 = info
            .lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .and_then(|l| l.split(',').find(|f| f.starts_with("usec=")))
            .and_then(|f| f[5..].parse().ok())
            .unwrap_or(f64::NAN);
        (jobs as f64 / wall.as_secs_f64(), usec / calls as f64)
    };
    let (mut old_runs, mut new_runs) = (Vec::new(), Vec::new());
    for pair in 0..pairs {
        // Alternate which goes first, so a drift of the machine's load favours neither.
        if pair % 2 == 0 {
            old_runs.push(run(&old_reserve, 8));
            new_runs.push(run(&new_reserve, 9));
        } else {
            new_runs.push(run(&new_reserve, 9));
            old_runs.push(run(&old_reserve, 8));
        }
    }
    drop(server);
    let median = |runs: &[(f64, f64)], pick: fn(&(f64, f64)) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(pick).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (old_rate, new_rate) = (median(&old_runs, |r| r.0), median(&new_runs, |r| r.0));
    let (old_us, new_us) = (median(&old_runs, |r| r.1), median(&new_runs, |r| r.1));
    // The least disturbed run of each side (the machine is shared), and the median of
    // the per-pair ratios.
    let best = |runs: &[(f64, f64)]| runs.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
    let mut ratios: Vec<f64> = old_runs
        .iter()
        .zip(&new_runs)
        .map(|(o, n)| n.1 / o.1)
        .collect();
    ratios.sort_by(|a, b| a.partial_cmp(b).unwrap());
    eprintln!(
        "unlimited reserve(100)+release, {jobs} jobs, {pairs} alternating pairs: \
         before {old_rate:.0} jobs/s, {old_us:.1} µs server time per pair (best {:.1}); \
         after {new_rate:.0} jobs/s, {new_us:.1} µs (best {:.1}); medians {:+.1} % throughput, \
         {:+.1} % server time; median per-pair server-time ratio {:+.1} %\n\
         before {old_runs:?}\nafter  {new_runs:?}",
        best(&old_runs),
        best(&new_runs),
        (new_rate / old_rate - 1.0) * 100.0,
        (new_us / old_us - 1.0) * 100.0,
        (ratios[ratios.len() / 2] - 1.0) * 100.0,
    );
}

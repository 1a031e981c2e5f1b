//! Jitter for recurring series (`x-redisched-jitter`, REST/CLI `jitter`): every
//! occurrence is delayed by FNV-1a-32(`topic \0 id \0 scheduled_ms`) mod the jitter
//! (clamped to the gap to the next occurrence), the record keeps the unjittered time so
//! the grid never drifts, and deliveries say both (`x-redisched-due-at`, jittered, and
//! `x-redisched-scheduled-at`). Through the scripts (`put.lua`'s `jitter_ms`, the
//! `+<delay>` lease of `release.lua`), real bridge children (a restart and a second
//! bridge recompute the same delays), a webhook target, and every face's refusals.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::bridge::*;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use redis::Commands;
use redisched::config::Config;
use redisched::job::schedule::{jitter_delay, Schedule};
use redisched::job::spec::ScheduleSpec;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{Delivered, Lease, NextDue, PutRequest};
use redisched_testkit::percentile;
use tokio::sync::mpsc;

const SECOND: Duration = Duration::from_secs(1);

fn topic(name: &str) -> Topic {
    Topic::new(name).expect("topic")
}

fn jid(id: &str) -> JobId {
    JobId::new(id).expect("id")
}

/// The stored meta of a jittered series, as REST and the CLI write it.
fn jitter_meta(jitter_ms: u64) -> Vec<u8> {
    redisched::job::meta::of_put(None, jitter_ms)
}

fn request(t: &Topic, id: &str, due: Due, meta: Vec<u8>) -> PutRequest {
    PutRequest {
        topic: t.clone(),
        id: jid(id),
        body: b"tick".to_vec(),
        meta,
        due,
        mode: PutMode::Keep,
    }
}

/// `scheduled` score and the record's due time (field 2 of both formats) of a job.
fn score_and_record_due(
    conn: &mut redis::Connection,
    prefix: &str,
    t: &str,
    id: &str,
) -> (Option<i64>, Option<i64>) {
    let score: Option<i64> = conn
        .zscore(format!("{prefix}:{{{t}}}:scheduled"), id)
        .expect("zscore");
    let record: Option<Vec<u8>> = conn
        .hget(format!("{prefix}:{{{t}}}:jobs"), id)
        .expect("hget");
    let due = record.and_then(|r| {
        String::from_utf8_lossy(&r)
            .split('|')
            .nth(1)
            .and_then(|d| d.parse().ok())
    });
    (score, due)
}

// ------------------------------------------------------------ through the scripts

/// put.lua computes the first occurrence's delay in Lua; the bridge computes every
/// later one in Rust: both must be the hash lua/README.md writes down, for any id.
#[tokio::test]
async fn put_lua_delays_the_first_occurrence_by_the_documented_hash_and_keeps_the_due_time() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let mut conn = common::raw_redis();
    let t = topic("jit.put");
    let spec = ScheduleSpec::every(60_000);
    let base = store.server_time().await.expect("time") + 3_600_000;
    let mut ids: Vec<String> = (0..250).map(|n| format!("user-{n}")).collect();
    ids.extend(
        ["ü-ñ-日本", "a b", "x".repeat(256).as_str(), "\u{10FFFF}"]
            .iter()
            .map(|s| s.to_string()),
    );
    let mut delays = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let due = base + n as i64 * 7_919;
        let outcome = store
            .put_jittered(
                request(&t, id, Due::At(due), jitter_meta(50_000)),
                spec.clone(),
                50_000,
            )
            .await
            .expect("put");
        assert_eq!(outcome.due_at, due, "the reply is the unjittered due time");
        let (score, record_due) = score_and_record_due(&mut conn, &store.prefix, t.as_str(), id);
        let expected = jitter_delay(t.as_str(), id, due, 50_000);
        assert_eq!(
            record_due,
            Some(due),
            "{id}: the record keeps the scheduled time"
        );
        assert_eq!(
            score,
            Some(due + expected as i64),
            "{id}: Lua and Rust agree on the delay"
        );
        delays.push(expected);
    }
    let (min, max) = (delays.iter().min(), delays.iter().max());
    assert!(min < Some(&2_000) && max > Some(&48_000), "{min:?} {max:?}");

    // An interval put with a delay: the script resolves the due time, then jitters it.
    let outcome = store
        .put_jittered(
            request(&t, "relative", Due::Delay(120_000), jitter_meta(50_000)),
            spec.clone(),
            50_000,
        )
        .await
        .expect("put");
    let (score, due) = score_and_record_due(&mut conn, &store.prefix, t.as_str(), "relative");
    assert_eq!(due, Some(outcome.due_at));
    assert_eq!(
        score,
        Some(outcome.due_at + jitter_delay(t.as_str(), "relative", outcome.due_at, 50_000) as i64)
    );
    // Without a jitter nothing changes: score = due.
    let outcome = store
        .put_recurring(request(&t, "plain", Due::At(base), Vec::new()), spec)
        .await
        .expect("put");
    let (score, due) = score_and_record_due(&mut conn, &store.prefix, t.as_str(), "plain");
    assert_eq!((score, due), (Some(outcome.due_at), Some(outcome.due_at)));
}

/// `<token>@<next>+<delay>`: the next occurrence waits at next + delay, the record (and
/// so the grid, and the history) keeps next.
#[tokio::test]
async fn a_release_with_a_delay_schedules_the_next_occurrence_late_and_keeps_the_grid() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let mut conn = common::raw_redis();
    let t = topic("jit.release");
    store
        .put_recurring(
            request(&t, "s", Due::Delay(0), jitter_meta(400)),
            ScheduleSpec::every(1_000),
        )
        .await
        .expect("put");
    let batch = store.reserve(&t, 30 * SECOND, 10).await.expect("reserve");
    let job = &batch.jobs[0];
    assert!(job.reserved_at >= job.due_at);
    let next = job.due_at + 1_000;
    let released = store
        .release_delivered(&[Delivered {
            lease: Lease {
                topic: t.clone(),
                id: "s".into(),
                token: job.token,
            },
            next_due: NextDue::Jittered {
                at: next,
                delay_ms: 321,
            },
        }])
        .await
        .expect("release");
    assert_eq!(released, 1);
    let (score, due) = score_and_record_due(&mut conn, &store.prefix, t.as_str(), "s");
    assert_eq!((score, due), (Some(next + 321), Some(next)));
    let history = store.history(&t, None, 10).await.expect("history");
    assert_eq!(history[0].detail, next.to_string(), "{history:?}");

    // Malformed delays are refused, and nothing in the call changes.
    let batch = store.reserve(&t, 30 * SECOND, 10).await.expect("reserve");
    assert!(batch.jobs.is_empty(), "not due before next + delay");
    conn.zadd::<_, _, _, ()>(
        format!("{}:{{jit.release}}:scheduled", store.prefix),
        "s",
        0,
    )
    .expect("make it due");
    let batch = store.reserve(&t, 30 * SECOND, 10).await.expect("reserve");
    let token = batch.jobs[0].token;
    let release = redis::Script::new(include_str!("../../lua/release.lua"));
    let keys = common::topic_keys(&store.prefix, "jit.release", common::FULL_KEY_NAMES);
    for lease in [
        format!("{token}@{}+x", next + 1_000),
        format!("{token}@{}+", next + 1_000),
        format!("{token}@-1+5"),
        format!("{token}@{}+-5", next + 1_000),
        format!("{token}@{}+12345678901234", next + 1_000),
    ] {
        let mut invoke = release.prepare_invoke();
        for key in &keys {
            invoke.key(key);
        }
        let err = invoke
            .arg("s")
            .arg(&lease)
            .invoke::<i64>(&mut conn)
            .expect_err(&lease);
        assert!(
            err.to_string().contains("INVALID_ARGUMENT") && err.to_string().contains("lease"),
            "{lease}: {err}"
        );
        let reserved: Option<f64> = conn.zscore(&keys[1], "s").expect("zscore reserved");
        assert!(reserved.is_some(), "{lease}: still reserved");
    }
}

/// put.lua refuses a jitter it cannot apply, and writes nothing.
#[tokio::test]
async fn put_lua_refuses_bad_jitter_values_and_writes_nothing() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let mut conn = common::raw_redis();
    let put = redis::Script::new(include_str!("../../lua/put.lua"));
    let keys = common::topic_keys(&store.prefix, "jit.bad", common::FULL_KEY_NAMES);
    for (spec, jitter, reason) in [
        ("", "500", "only for a recurring job"),
        ("every:1000", "-1", "jitter_ms must be"),
        ("every:1000", "soon", "jitter_ms must be"),
        ("every:1000", "1.5", "jitter_ms must be"),
        ("every:1000", "1000000000001", "jitter_ms must be"),
    ] {
        let mut invoke = put.prepare_invoke();
        for key in &keys {
            invoke.key(key);
        }
        let err = invoke
            .arg("j")
            .arg("body")
            .arg("")
            .arg("nx")
            .arg("delay")
            .arg(0)
            .arg(31_622_400_000_i64)
            .arg(1_048_576)
            .arg("")
            .arg(spec)
            .arg("")
            .arg("")
            .arg(jitter)
            .invoke::<redis::Value>(&mut conn)
            .expect_err(jitter);
        assert!(
            err.to_string().contains("INVALID_ARGUMENT") && err.to_string().contains(reason),
            "{spec} {jitter}: {err}"
        );
        let records: i64 = conn.hlen(&keys[2]).expect("hlen");
        assert_eq!(records, 0, "{spec} {jitter}: nothing written");
    }
}

// --------------------------------------------------------------- real bridges

/// The occurrences of many series at a consumer: id → scheduled time → (due, arrivals).
#[derive(Default)]
struct Seen {
    by_id: HashMap<String, BTreeMap<i64, (i64, Vec<i64>)>>,
    all: Vec<(String, i64, i64, i64)>,
}

impl Seen {
    fn add(&mut self, arrived: i64, d: &Delivery) {
        let id = message_id(d);
        let due = header_i64(d, "x-redisched-due-at").expect("x-redisched-due-at");
        let scheduled =
            header_i64(d, "x-redisched-scheduled-at").expect("x-redisched-scheduled-at");
        let entry = self
            .by_id
            .entry(id.clone())
            .or_default()
            .entry(scheduled)
            .or_insert((due, Vec::new()));
        assert_eq!(
            entry.0, due,
            "{id}: a redelivered occurrence has the same jittered due time"
        );
        entry.1.push(arrived);
        self.all.push((id, scheduled, due, arrived));
    }
}

async fn drain_until(
    rx: &mut mpsc::UnboundedReceiver<(i64, Delivery)>,
    seen: &mut Seen,
    until_ms: i64,
) {
    loop {
        let left = until_ms - now_ms();
        if left <= 0 {
            return;
        }
        match tokio::time::timeout(Duration::from_millis(left as u64), rx.recv()).await {
            Ok(Some((arrived, d))) => seen.add(arrived, &d),
            Ok(None) | Err(_) => return,
        }
    }
}

/// Stops a child bridge without stalling the consumer task that stamps arrivals.
fn terminate(bridge: &mut ChildBridge) {
    let (status, _) = tokio::task::block_in_place(|| bridge.terminate());
    assert!(status.success(), "SIGTERM exits 0, got {status:?}");
}

/// 200 series every 1 s with a 500 ms jitter for 13 occurrences, across three bridge
/// processes: A alone, A and B, B alone, B and C, C alone (a second bridge and a
/// restarted one). Every delivery's delay is the documented hash of its occurrence
/// (whoever released it), in [0, 500), spread over the range; never early; the
/// scheduled times stay on each series' 1-s grid with no occurrence lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow: bash scripts/test.sh runs it"]
async fn two_hundred_jittered_series_keep_their_grid_and_delays_across_bridges() {
    // Alone in its binary: three bridge processes and a lateness bound in milliseconds.
    let _alone = common::timed::alone().await;
    const SERIES: usize = 200;
    const JITTER: u64 = 500;
    const ROUNDS: i64 = 13;
    let config = test_config("jit200");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready_stamped("#").await;
    let mut a = ChildBridge::start(&config);
    let t0 = (now_ms() / 1000 + 4) * 1000;
    for n in 0..SERIES {
        broker
            .put(
                "ticks",
                &format!("user-{n}"),
                b"tick",
                &[
                    ("x-redisched-every", AMQPValue::LongInt(1000)),
                    ("x-redisched-jitter", AMQPValue::LongInt(JITTER as i32)),
                    ("x-deliver-at", AMQPValue::LongLongInt(t0)),
                ],
            )
            .await;
    }
    assert!(
        now_ms() < t0 - 500,
        "the puts took too long to test the first round"
    );
    let mut seen = Seen::default();
    drain_until(&mut ready, &mut seen, t0 + 3_200).await;
    let mut b = ChildBridge::start(&config);
    drain_until(&mut ready, &mut seen, t0 + 5_700).await;
    terminate(&mut a);
    drain_until(&mut ready, &mut seen, t0 + 8_200).await;
    let mut c = ChildBridge::start(&config);
    drain_until(&mut ready, &mut seen, t0 + 10_700).await;
    terminate(&mut b);
    drain_until(&mut ready, &mut seen, t0 + ROUNDS * 1000 + 600).await;
    terminate(&mut c);
    broker.cleanup().await;

    // The documented delay, on the grid, never early, never past the next occurrence.
    let mut lateness = Vec::new();
    let mut wrong = Vec::new();
    for (id, scheduled, due, arrived) in &seen.all {
        let expected = jitter_delay("ticks", id, *scheduled, JITTER) as i64;
        if (scheduled - t0) % 1000 != 0 || *scheduled < t0 || due - scheduled != expected {
            wrong.push((id.clone(), scheduled - t0, due - scheduled, expected));
        }
        lateness.push(arrived - due);
    }
    assert!(
        wrong.is_empty(),
        "(id, scheduled − t0, delay, expected): {wrong:?}"
    );
    let early: Vec<i64> = lateness.iter().copied().filter(|&l| l < 0).collect();
    assert!(
        early.is_empty(),
        "delivered before the jittered due time by {early:?} ms"
    );

    // Every occurrence 0..ROUNDS of every series, exactly once.
    let mut missing = Vec::new();
    let mut doubled = 0;
    for n in 0..SERIES {
        let id = format!("user-{n}");
        let got = seen.by_id.get(&id);
        for k in 0..ROUNDS {
            match got.and_then(|m| m.get(&(t0 + k * 1000))) {
                None => missing.push((id.clone(), k)),
                Some((_, arrivals)) if arrivals.len() > 1 => doubled += 1,
                Some(_) => {}
            }
        }
    }
    assert!(
        missing.is_empty(),
        "(id, occurrence) never delivered: {missing:?}"
    );
    assert_eq!(doubled, 0, "occurrences delivered twice");

    // Spread over [0, 500): the first round (put.lua's delays) and all rounds.
    let first: Vec<i64> = seen
        .all
        .iter()
        .filter(|(_, s, _, _)| *s == t0)
        .map(|(_, s, d, _)| d - s)
        .collect();
    let delays: Vec<i64> = seen.all.iter().map(|(_, s, d, _)| d - s).collect();
    let mut buckets = [0usize; 5];
    for d in &delays {
        buckets[(*d / 100) as usize] += 1;
    }
    let (first_min, first_max) = (first.iter().min(), first.iter().max());
    let (min, max) = (delays.iter().min(), delays.iter().max());
    lateness.sort_unstable();
    eprintln!(
        "{} deliveries; delays min {min:?} max {max:?}, first round min {first_min:?} max {first_max:?}, per 100 ms {buckets:?}; lateness p50 {} p99 {} max {} ms",
        seen.all.len(),
        percentile(&lateness, 0.5),
        percentile(&lateness, 0.99),
        lateness.last().copied().unwrap_or(0)
    );
    assert!(
        first_min < Some(&100) && first_max > Some(&400),
        "first round {first:?}"
    );
    assert!(min < Some(&25) && max > Some(&475), "{min:?} {max:?}");
    let expected = delays.len() as f64 / 5.0;
    assert!(
        buckets
            .iter()
            .all(|&b| (b as f64) > 0.7 * expected && (b as f64) < 1.3 * expected),
        "roughly uniform per 100 ms: {buckets:?} (expected about {expected} each)"
    );
    // Jitter is not lateness: deliveries stay close to their jittered due time (a
    // generous bound: three debug-build bridges share two cores here).
    let p99 = percentile(&lateness, 0.99);
    assert!(p99 <= 250, "p99 lateness {p99} ms");
}

/// A six-field cron every second with a jitter of 5 s: clamped to the 1-s gap, so each
/// occurrence is delayed by the hash mod 1000 and arrives before the next one is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_jitter_is_clamped_to_the_gap_and_recomputed_for_every_occurrence() {
    let _shared = common::timed::shared().await;
    const SERIES: usize = 20;
    let config = test_config("jitcron");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready_stamped("#").await;
    let mut bridge = ChildBridge::start(&config);
    let start = (now_ms() / 1000 + 3) * 1000;
    for n in 0..SERIES {
        broker
            .put(
                "cronj",
                &format!("c-{n}"),
                b"tick",
                &[
                    ("x-redisched-cron", text("* * * * * *")),
                    ("x-redisched-jitter", AMQPValue::LongInt(5_000)),
                    ("x-deliver-at", AMQPValue::LongLongInt(start)),
                ],
            )
            .await;
    }
    let mut seen = Seen::default();
    drain_until(&mut ready, &mut seen, start + 7_000).await;
    terminate(&mut bridge);
    broker.cleanup().await;

    let cron = Schedule::cron("* * * * * *", None).expect("cron");
    let mut wrong = Vec::new();
    for (id, scheduled, due, arrived) in &seen.all {
        let expected = cron.occurrence_delay("cronj", id, *scheduled, 5_000) as i64;
        if scheduled % 1000 != 0
            || *scheduled < start
            || due - scheduled != expected
            || due - scheduled >= 1000
            || arrived < due
        {
            wrong.push((
                id.clone(),
                *scheduled,
                due - scheduled,
                expected,
                arrived - due,
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "(id, scheduled, delay, expected, lateness): {wrong:?}"
    );
    for n in 0..SERIES {
        let id = format!("c-{n}");
        let got: Vec<i64> = seen.by_id[&id].keys().copied().collect();
        let expected: Vec<i64> = (0..6).map(|k| start + k * 1000).collect();
        assert!(
            got.starts_with(&expected),
            "{id}: every second, none lost: {got:?}"
        );
    }
    let delays: Vec<i64> = seen.all.iter().map(|(_, s, d, _)| d - s).collect();
    let (min, max) = (delays.iter().min(), delays.iter().max());
    assert!(min < Some(&150) && max > Some(&850), "{min:?} {max:?}");
}

/// An occurrence waiting at its unjittered time (as a bridge of the release before
/// jitter releases one, or `check --repair` re-indexes one) is delivered then, with
/// due-at = scheduled-at (never a due time later than it was due), and the next
/// occurrence is jittered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_occurrence_scheduled_without_its_delay_is_due_at_its_scheduled_time() {
    let _shared = common::timed::shared().await;
    let config = test_config("jitold");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready_stamped("#").await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let t = topic("oldj");
    // Pick an id whose first delay is large, so "reserved early" is unambiguous.
    let start = (store.server_time().await.expect("time") / 1000 + 3) * 1000;
    let id = (0..)
        .map(|n| format!("o-{n}"))
        .find(|id| {
            jitter_delay("oldj", id, start, 900) >= 400
                && jitter_delay("oldj", id, start + 1000, 900) >= 100
        })
        .expect("an id");
    store
        .put_recurring(
            request(&t, &id, Due::At(start), jitter_meta(900)),
            ScheduleSpec::every(1_000),
        )
        .await
        .expect("put without the first delay");
    let mut bridge = ChildBridge::start(&config);
    let mut seen = Seen::default();
    drain_until(&mut ready, &mut seen, start + 3_000).await;
    terminate(&mut bridge);
    broker.cleanup().await;
    let got = &seen.by_id[&id];
    let (due0, arrivals0) = &got[&start];
    assert_eq!(*due0, start, "due at its scheduled time: {got:?}");
    assert!(
        arrivals0[0] >= start && arrivals0[0] < start + 400,
        "{got:?}"
    );
    let (due1, arrivals1) = &got[&(start + 1000)];
    assert_eq!(
        *due1,
        start + 1000 + jitter_delay("oldj", &id, start + 1000, 900) as i64,
        "the next one is jittered again: {got:?}"
    );
    assert!(arrivals1[0] >= *due1, "{got:?}");
}

/// Webhook deliveries carry the jittered due time and the scheduled one, as headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_deliveries_carry_the_jittered_due_time_and_the_scheduled_one() {
    let _shared = common::timed::shared().await;
    let receiver = common::receiver::Receiver::start().await;
    let mut config = test_config("jithook");
    config.targets = vec![redisched::targets::TargetConfig {
        name: "hook".into(),
        topics: vec!["hooked".into()],
        url: receiver.url("/in"),
        timeout_ms: 2_000,
        ..Default::default()
    }];
    config.validate().expect("valid config");
    let store = common::test_store_named(&config.redis.prefix).await;
    // No AMQP command here, but the bridge declares its topology: removed at the end.
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    let t = topic("hooked");
    let start = store.server_time().await.expect("time") + 1_500;
    let schedule = Schedule::every(1_000, 1).expect("every");
    store
        .put_jittered(
            request(&t, "h", Due::At(start), jitter_meta(700)),
            schedule.store_spec().expect("spec"),
            700,
        )
        .await
        .expect("put");
    let got = receiver.wait_for(2, 10 * SECOND).await;
    bridge.stop().await;
    delete_bridge_keys(&config);
    broker.cleanup().await;
    assert!(got.len() >= 2, "{} requests", got.len());
    for (k, r) in got.iter().take(2).enumerate() {
        let scheduled: i64 = r
            .header("x-redisched-scheduled-at")
            .and_then(|v| v.parse().ok())
            .expect("x-redisched-scheduled-at");
        let due: i64 = r
            .header("x-redisched-due-at")
            .and_then(|v| v.parse().ok())
            .expect("x-redisched-due-at");
        assert_eq!(scheduled, start + k as i64 * 1000);
        assert_eq!(
            due,
            scheduled + jitter_delay("hooked", "h", scheduled, 700) as i64
        );
        assert!(r.epoch_ms >= due, "posted {} ms early", due - r.epoch_ms);
    }
}

fn delete_bridge_keys(config: &Config) {
    common::delete_prefix(&config.redis.prefix);
}

// ------------------------------------------------------------------ refusals

/// AMQP commands with a bad jitter are set aside with the reason; nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_jitter_commands_are_set_aside_with_a_reason_and_nothing_is_stored() {
    let _shared = common::timed::shared().await;
    let config = test_config("jitbad");
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let bridge = InProcess::start(&config);
    let every = ("x-redisched-every", AMQPValue::LongInt(1000));
    type Case<'a> = (&'a str, Vec<(&'a str, AMQPValue)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "negative",
            vec![
                every.clone(),
                ("x-redisched-jitter", AMQPValue::LongInt(-5)),
            ],
            "not a number of milliseconds >= 0",
        ),
        (
            "words",
            vec![every.clone(), ("x-redisched-jitter", text("soon"))],
            "not a number of milliseconds >= 0",
        ),
        (
            "float",
            vec![
                every.clone(),
                ("x-redisched-jitter", AMQPValue::Double(1.5)),
            ],
            "integer number of milliseconds",
        ),
        (
            "interval",
            vec![
                every.clone(),
                ("x-redisched-jitter", AMQPValue::LongInt(1000)),
            ],
            "below the interval of 1000 ms",
        ),
        (
            "one-shot",
            vec![("x-redisched-jitter", AMQPValue::LongInt(100))],
            "only used with",
        ),
    ];
    for (id, headers, _) in &cases {
        broker.put("badj", id, b"x", headers).await;
    }
    let got = invalid.collect(cases.len(), 10 * SECOND).await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let stats = store.stats(&topic("badj")).await.expect("stats");
    bridge.stop().await;
    broker.cleanup().await;
    assert_eq!(got.len(), cases.len(), "every bad command set aside");
    for (id, _, reason) in &cases {
        let d = got
            .iter()
            .map(|(_, d)| d)
            .find(|d| message_id(d) == *id)
            .unwrap_or_else(|| panic!("{id} not set aside"));
        let error = header_text(d, "x-redisched-error").expect("x-redisched-error");
        assert!(
            error.contains("x-redisched-jitter") && error.contains(reason),
            "{id}: {error}"
        );
    }
    assert_eq!(stats.records, 0, "nothing stored");
}

/// REST `jitter=` and CLI `--jitter`: bad values are 400 / usage errors naming the
/// reason, nothing is stored; a good one is kept with the job and jitters it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_and_cli_refuse_bad_jitter_and_store_a_good_one() {
    let _shared = common::timed::shared().await;
    let store = common::test_store().await;
    let mut config = Config::default();
    config.limits.min_interval_ms = 100;
    let common::api::Served {
        base,
        client,
        shutdown,
        task: server,
        ..
    } = common::api::serve(store.store.clone(), config).await;
    let put = |query: &str| {
        client
            .put(format!("{base}/v1/topics/restj/jobs/r1?{query}"))
            .body("x")
            .send()
    };
    // Not in the documented form, or alone: 400; well-formed but not below the
    // interval (no schema can say so): 422 `invalid_schedule`.
    let (bad, unusable) = (400, 422);
    for (query, want, reason) in [
        ("every=1000&jitter=-5", bad, "not a number of milliseconds"),
        ("every=1000&jitter=abc", bad, "not a number of milliseconds"),
        ("every=1000&jitter=1000", unusable, "below the interval"),
        ("every=1000&jitter=", bad, "must not be empty"),
        ("jitter=100", bad, "only for a recurring job"),
    ] {
        let response = put(query).await.expect("request");
        let status = response.status();
        let text = response.text().await.expect("body");
        assert_eq!(status.as_u16(), want, "{query}: {text}");
        assert!(text.contains(reason), "{query}: {text}");
    }
    let t = topic("restj");
    assert_eq!(store.stats(&t).await.expect("stats").records, 0);

    let response = put("every=1000&jitter=600&delay_ms=60000")
        .await
        .expect("request");
    assert!(
        response.status().is_success(),
        "{:?}",
        response.text().await
    );
    let mut conn = common::raw_redis();
    let (score, due) = score_and_record_due(&mut conn, &store.prefix, "restj", "r1");
    let due = due.expect("stored");
    assert_eq!(
        score,
        Some(due + jitter_delay("restj", "r1", due, 600) as i64)
    );
    let info = store.get(&t, &jid("r1")).await.expect("get").expect("job");
    let meta = redisched::job::meta::decode_meta(&info.meta).expect("meta");
    assert_eq!(
        redisched::job::meta::jitter_of(&meta),
        600,
        "kept for dispatch"
    );
    let shown: serde_json::Value = client
        .get(format!("{base}/v1/topics/restj/jobs/r1"))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(shown["jitter_ms"], 600, "{shown}");
    assert_eq!(shown["every_ms"], 1000, "{shown}");
    assert_eq!(
        shown["due_at"],
        score.expect("score"),
        "the jittered next due time"
    );
    shutdown.cancel();
    let _ = server.await;

    // The CLI, on the same store.
    let cli = |args: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_redisched"));
        for (key, _) in std::env::vars() {
            if key.starts_with("REDISCHED_") || key == "RUST_LOG" {
                cmd.env_remove(key);
            }
        }
        cmd.env("REDISCHED_REDIS__URL", common::redis_url())
            .env("REDISCHED_REDIS__PREFIX", &store.prefix)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run redisched")
    };
    for (args, reason) in [
        (
            vec!["put", "clij", "c1", "x", "--every", "1s", "--jitter=-5"],
            "not a number of milliseconds",
        ),
        (
            vec!["put", "clij", "c1", "x", "--every", "1s", "--jitter", "1s"],
            "not a number of milliseconds",
        ),
        (
            vec![
                "put", "clij", "c1", "x", "--every", "1s", "--jitter", "1000",
            ],
            "below the interval",
        ),
        (
            vec!["put", "clij", "c1", "x", "--jitter", "10"],
            "only for a recurring job",
        ),
    ] {
        let out = cli(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
    }
    assert_eq!(store.stats(&topic("clij")).await.expect("stats").records, 0);
    let out = cli(&[
        "put", "clij", "c1", "x", "--every", "1h", "--jitter", "250000", "--delay", "1h",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (score, due) = score_and_record_due(&mut conn, &store.prefix, "clij", "c1");
    let due = due.expect("stored");
    assert_eq!(
        score,
        Some(due + jitter_delay("clij", "c1", due, 250_000) as i64)
    );
    let out = cli(&["get", "clij", "c1", "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(shown["jitter_ms"], 250_000, "{shown}");
}

//! Recurring schedules end to end (README "Recurring schedules over AMQP"): series put
//! over AMQP with `x-redisched-every` / `x-redisched-cron`, dispatched by real bridges
//! against the real Redis and RabbitMQ, observed on the ready exchange.

use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use common::bridge::*;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use redisched::config::Config;
use redisched::job::{JobId, Topic};

const SECOND: Duration = Duration::from_secs(1);

/// A test config where a one-second interval is well above the minimum.
fn series_config(label: &str) -> Config {
    let mut config = test_config(label);
    config.limits.min_interval_ms = 200;
    config.dispatch.ttr_ms = 1_000;
    config
}

fn due_at(delivery: &Delivery) -> i64 {
    header_i64(delivery, "x-redisched-due-at").expect("x-redisched-due-at")
}

/// The distinct occurrences (due times) delivered per id, in order.
fn occurrences(got: &[(i64, Delivery)]) -> HashMap<String, Vec<i64>> {
    let mut by_id: HashMap<String, BTreeSet<i64>> = HashMap::new();
    for (_, d) in got {
        by_id.entry(message_id(d)).or_default().insert(due_at(d));
    }
    by_id
        .into_iter()
        .map(|(id, dues)| (id, dues.into_iter().collect()))
        .collect()
}

/// How many times the id is in the topic's `scheduled` and `reserved` sets together.
fn indexed(config: &Config, topic: &str, id: &str) -> usize {
    let mut conn = common::raw_redis();
    ["scheduled", "reserved"]
        .iter()
        .filter(|set| {
            let key = format!("{}:{{{topic}}}:{set}", config.redis.prefix);
            let score: Option<f64> = redis::cmd("ZSCORE")
                .arg(key)
                .arg(id)
                .query(&mut conn)
                .expect("ZSCORE");
            score.is_some()
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_series_is_spaced_on_time_never_early_and_delete_ends_it() {
    let _shared = common::timed::shared().await;
    let config = series_config("every");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);

    let sent = now_ms();
    broker
        .put(
            "digest",
            "every-second",
            b"tick",
            &[("x-redisched-every", AMQPValue::LongInt(1000))],
        )
        .await;
    let got = ready.collect(4, 15 * SECOND).await;
    assert_eq!(got.len(), 4, "four occurrences within 15 s");
    let dues: Vec<i64> = got.iter().map(|(_, d)| due_at(d)).collect();
    // The first occurrence is one interval after the put was applied (server clock,
    // same host; applying takes a moment after `sent` on a busy machine).
    assert!(
        dues[0] >= sent + 1000 - 50 && dues[0] < sent + 3000,
        "first due {} vs sent {sent}",
        dues[0]
    );
    for pair in dues.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            1000,
            "occurrences exactly 1 s apart: {dues:?}"
        );
    }
    for (arrived, d) in &got {
        let due = due_at(d);
        assert!(*arrived >= due, "delivered {} ms early", due - arrived);
        assert!(arrived - due < 1_000, "delivered {} ms late", arrived - due);
        assert_eq!(message_id(d), "every-second");
        assert_eq!(d.data, b"tick");
        assert_eq!(header_i64(d, "x-redisched-attempt"), Some(1));
        // The schedule header travels with each occurrence as given.
        assert_eq!(
            header(d, "x-redisched-every"),
            Some(&AMQPValue::LongInt(1000))
        );
    }

    // Delete ends the series: at most an occurrence already in flight, none after.
    broker
        .put(
            "digest",
            "every-second",
            b"",
            &[("x-redisched-op", text("delete"))],
        )
        .await;
    let deleted_at = now_ms();
    let after = ready.drain(2 * SECOND).await;
    assert!(
        after.iter().all(|(arrived, _)| *arrived < deleted_at + 500),
        "occurrences after the delete: {:?}",
        after
            .iter()
            .map(|(a, d)| (*a, due_at(d)))
            .collect::<Vec<_>>()
    );
    let store = common::test_store_named(&config.redis.prefix).await;
    let topic = Topic::new("digest").unwrap();
    assert_eq!(
        store
            .get(&topic, &JobId::new("every-second").unwrap())
            .await
            .unwrap(),
        None,
        "the series is gone"
    );
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_six_field_cron_fires_on_even_seconds() {
    let _shared = common::timed::shared().await;
    let config = series_config("cron6");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);

    broker
        .put(
            "even",
            "even-seconds",
            b"tock",
            &[("x-redisched-cron", text("*/2 * * * * *"))],
        )
        .await;
    let got = ready.collect(3, 15 * SECOND).await;
    assert_eq!(got.len(), 3, "three occurrences within 15 s");
    let dues: Vec<i64> = got.iter().map(|(_, d)| due_at(d)).collect();
    for due in &dues {
        assert_eq!(due % 2_000, 0, "an even second: {dues:?}");
    }
    for pair in dues.windows(2) {
        assert_eq!(pair[1] - pair[0], 2_000, "every two seconds: {dues:?}");
    }
    for (arrived, d) in &got {
        assert!(*arrived >= due_at(d), "never early");
        assert_eq!(
            header_text(d, "x-redisched-cron").as_deref(),
            Some("*/2 * * * * *")
        );
    }
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_berlin_schedule_is_stored_at_nine_local_across_the_dst_change() {
    let _shared = common::timed::shared().await;
    let config = series_config("berlin");
    let broker = Broker::new(&config).await;
    let bridge = InProcess::start(&config);
    // Saturday 2027-03-27 12:00 UTC: the next 09:00 in Berlin is on Sunday, the day
    // summer time starts, so 07:00 UTC (not 08:00).
    broker
        .put(
            "berlin",
            "morning",
            b"",
            &[
                ("x-redisched-cron", text("0 9 * * *")),
                ("x-redisched-tz", text("Europe/Berlin")),
                ("x-deliver-at", AMQPValue::LongLongInt(1_806_148_800_000)),
            ],
        )
        .await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let topic = Topic::new("berlin").unwrap();
    let id = JobId::new("morning").unwrap();
    let mut job = None;
    for _ in 0..50 {
        job = store.get(&topic, &id).await.unwrap();
        if job.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let job = job.expect("the series is stored");
    assert_eq!(job.due_at, 1_806_217_200_000, "2027-03-28T07:00:00Z");
    assert_eq!(job.spec.as_deref(), Some("cron:0 9 * * *|Europe/Berlin"));
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replace_changes_body_and_schedule_and_bad_schedules_are_set_aside() {
    let _shared = common::timed::shared().await;
    let config = series_config("replace");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let bridge = InProcess::start(&config);

    broker
        .put("swap", "s", b"old", &[("x-redisched-every", text("1000"))])
        .await;
    let (_, first) = ready.next(10 * SECOND).await.expect("an old occurrence");
    assert_eq!(first.data, b"old");
    broker
        .put(
            "swap",
            "s",
            b"new",
            &[
                ("x-redisched-op", text("replace")),
                ("x-redisched-cron", text("*/2 * * * * *")),
                ("x-redisched-tz", text("UTC")),
            ],
        )
        .await;
    let replaced_at = now_ms();
    let got = ready.collect(4, 15 * SECOND).await;
    let new: Vec<&Delivery> = got
        .iter()
        .filter(|(arrived, _)| *arrived > replaced_at + 500)
        .map(|(_, d)| d)
        .collect();
    assert!(new.len() >= 2, "occurrences of the replaced series");
    for d in &new {
        assert_eq!(d.data, b"new");
        assert_eq!(due_at(d) % 2_000, 0);
        assert_eq!(header(d, "x-redisched-every"), None);
        assert_eq!(header_text(d, "x-redisched-tz").as_deref(), Some("UTC"));
    }

    // A plain put on the existing id is a duplicate: the series is unchanged.
    broker
        .put(
            "swap",
            "s",
            b"ignored",
            &[("x-redisched-every", AMQPValue::LongInt(5000))],
        )
        .await;
    let (_, later) = ready
        .next(10 * SECOND)
        .await
        .expect("still the cron series");
    assert_eq!(later.data, b"new");

    let cases: &[(&[(&str, AMQPValue)], &str)] = &[
        (
            &[
                ("x-redisched-every", AMQPValue::LongInt(1000)),
                ("x-redisched-cron", text("* * * * *")),
            ],
            "both",
        ),
        (&[("x-redisched-tz", text("UTC"))], "only used with"),
        (&[("x-redisched-cron", text("0 0 30 2 *"))], "never fires"),
        (
            &[
                ("x-redisched-cron", text("0 9 * * *")),
                ("x-redisched-tz", text("Mars/Olympus")),
            ],
            "unknown time zone",
        ),
        (
            &[("x-redisched-every", AMQPValue::LongInt(50))],
            "below the minimum",
        ),
        (
            &[("x-redisched-cron", text("not cron"))],
            "x-redisched-cron",
        ),
        (&[("x-redisched-repeat", text("yes"))], "unknown header"),
    ];
    for (i, (headers, _)) in cases.iter().enumerate() {
        broker.put("swap", &format!("bad-{i}"), b"b", headers).await;
    }
    let set_aside = invalid.collect(cases.len(), 10 * SECOND).await;
    assert_eq!(set_aside.len(), cases.len());
    for ((_, msg), (_, reason)) in set_aside.iter().zip(cases) {
        let error = header_text(msg, "x-redisched-error").expect("reason");
        assert!(
            error.contains(reason),
            "{error:?} should mention {reason:?}"
        );
    }
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_series_leaves_exactly_one_chain_and_coalesces_missed_occurrences() {
    let _shared = common::timed::shared().await;
    let config = series_config("serieskill");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let ids: Vec<String> = (0..5).map(|i| format!("series-{i}")).collect();
    for id in &ids {
        broker
            .put(
                "chain",
                id,
                b"x",
                &[("x-redisched-every", AMQPValue::LongInt(1000))],
            )
            .await;
    }
    let mut bridge = ChildBridge::start(&config);
    let mut got = ready.collect(10, 20 * SECOND).await;
    assert_eq!(got.len(), 10, "the child bridge dispatches the series");
    bridge.kill9();
    // Killed: occurrences are missed for 3 s. Each series is still one record in one
    // set, whether the kill caught it scheduled or reserved.
    for id in &ids {
        assert_eq!(indexed(&config, "chain", id), 1, "{id} indexed once");
    }
    tokio::time::sleep(3 * SECOND).await;
    let restart = now_ms();
    let mut restarted = ChildBridge::start(&config);
    let after = ready.collect(25, 20 * SECOND).await;
    let (status, _) = restarted.terminate();
    assert!(status.success(), "SIGTERM exits 0, got {status:?}");

    let post = occurrences(&after);
    got.extend(after);
    let all = occurrences(&got);
    for id in &ids {
        let dues = &all[id];
        // One chain: every occurrence on the id's one-second grid, none lost after the
        // restart (the series goes on).
        for pair in dues.windows(2) {
            assert_eq!(
                (pair[1] - pair[0]) % 1000,
                0,
                "{id}: off the grid, a second chain? {dues:?}"
            );
        }
        let resumed = &post[id];
        assert!(
            resumed.iter().filter(|&&d| d > restart).count() >= 2,
            "{id} goes on after the restart: {resumed:?}"
        );
        // Coalesced: of the occurrences missed while no bridge ran, one is delivered.
        let overdue = resumed.iter().filter(|&&d| d < restart).count();
        assert!(
            overdue <= 1,
            "{id}: {overdue} missed occurrences delivered: {resumed:?}"
        );
        assert_eq!(indexed(&config, "chain", id), 1, "{id} indexed once");
    }
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_bridges_on_one_series_never_double_it() {
    let _shared = common::timed::shared().await;
    let config = series_config("seriespair");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let first = InProcess::start(&config);
    let second = InProcess::start(&config);
    for i in 0..3 {
        broker
            .put(
                "pair",
                &format!("p-{i}"),
                b"x",
                &[("x-redisched-every", AMQPValue::LongInt(500))],
            )
            .await;
    }
    let got = ready.collect(3 * 8, 20 * SECOND).await;
    first.stop().await;
    second.stop().await;
    assert_eq!(got.len(), 24);
    let mut seen: HashMap<(String, i64), usize> = HashMap::new();
    for (_, d) in &got {
        *seen.entry((message_id(d), due_at(d))).or_default() += 1;
    }
    let doubled: Vec<_> = seen.iter().filter(|(_, &n)| n > 1).collect();
    assert!(
        doubled.is_empty(),
        "occurrences delivered twice: {doubled:?}"
    );
    for (id, dues) in occurrences(&got) {
        for pair in dues.windows(2) {
            // On the series' grid (a release late by a whole interval coalesces).
            let gap = pair[1] - pair[0];
            assert!(
                gap > 0 && gap % 500 == 0,
                "{id}: one chain on a 500 ms grid: {dues:?}"
            );
        }
    }
    broker.cleanup().await;
}

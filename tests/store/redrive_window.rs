//! `Store::redrive_window_step`, `redrive_window` and `redrive_window_topics` against a
//! real Redis: parked jobs chosen by the time of their last failure, in bounded steps
//! (at most 1,000 failing entries examined per script call), resumable by cursor.

use crate::common;

use redis::Commands;
use redisched::job::window::FailureWindow;
use redisched::job::{JobId, Topic};
use redisched::store::{JobState, Outcome};

const PARKED: i64 = 100_000_000_000_000_000;

/// `n` jobs `<label>-<i>` parked raw (as `retry.lua` leaves them), the i-th having last
/// failed at `first_error_at + i`.
fn park_many(prefix: &str, topic: &str, label: &str, n: i64, first_error_at: i64) {
    let keys = common::topic_keys(prefix, topic, common::FULL_KEY_NAMES);
    let mut conn = common::raw_redis();
    let mut pipe = redis::pipe();
    for i in 0..n {
        let id = format!("{label}-{i:05}");
        let at = first_error_at + i;
        let rec = format!("2|1000|2|9|2|{at}|0|3|0|500body");
        pipe.hset(&keys[2], &id, rec).ignore();
        pipe.zadd(&keys[0], &id, PARKED).ignore();
        pipe.zadd(&keys[7], &id, at).ignore();
    }
    let _: () = pipe.query(&mut conn).unwrap();
    let _: () = conn.sadd(format!("{prefix}:topics"), topic).unwrap();
}

#[tokio::test]
async fn steps_are_bounded_and_resume_by_cursor() {
    let store = common::test_store().await;
    let topic = Topic::new("window.steps").unwrap();
    park_many(&store.prefix, topic.as_str(), "j", 2_500, 10_000);
    let window = FailureWindow {
        since: 10_100,
        until: 12_199,
    };
    // 2,100 jobs in the window: 1000 + 1000 + 100, the last step without a cursor.
    let first = store
        .redrive_window_step(&topic, window, None, 5_000)
        .await
        .unwrap();
    assert_eq!(
        (first.moved, first.scanned),
        (1_000, 1_000),
        "count is clamped to 1000"
    );
    assert_eq!(first.cursor.as_deref(), Some("11099:j-01099"));
    let again = store
        .redrive_window_step(&topic, window, None, 1_000)
        .await
        .unwrap();
    assert_eq!(
        (again.moved, again.scanned),
        (0, 1_000),
        "a repeated step moves nothing"
    );
    let mut cursor = first.cursor;
    let mut moved = first.moved;
    let mut steps = 1;
    while let Some(at) = cursor {
        let step = store
            .redrive_window_step(&topic, window, Some(&at), 1_000)
            .await
            .unwrap();
        assert!(step.scanned <= 1_000);
        moved += step.moved;
        cursor = step.cursor;
        steps += 1;
    }
    assert_eq!((moved, steps), (2_100, 3));
    let stats = store.stats(&topic).await.unwrap();
    assert_eq!(stats.parked, 400, "those before and after the window stay");
    let get = |id: &str| {
        let (store, topic, id) = (store.store.clone(), topic.clone(), JobId::new(id).unwrap());
        async move { store.get(&topic, &id).await.unwrap().unwrap() }
    };
    assert_eq!(get("j-00099").await.state, JobState::Parked);
    assert_eq!(get("j-00100").await.state, JobState::Scheduled);
    assert_eq!(get("j-02199").await.state, JobState::Scheduled);
    assert_eq!(get("j-02200").await.state, JobState::Parked);
    let job = get("j-01500").await;
    assert_eq!((job.attempts, job.failures), (2, 2), "counters kept");

    // The whole walk over everything: the 400 left, in three script calls.
    let all = FailureWindow {
        since: 0,
        until: store.server_time().await.unwrap(),
    };
    assert_eq!(store.redrive_window(&topic, all).await.unwrap(), 400);
    assert_eq!(store.stats(&topic).await.unwrap().parked, 0);
    let logged = store.history(&topic, None, 1_000).await.unwrap();
    assert_eq!(logged.len(), 1_000, "the history is capped at history_max");
    assert!(logged.iter().all(|h| h.outcome == Outcome::Redriven));
    let report = store.check(&topic, false).await.unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[tokio::test]
async fn several_topics_answer_each_their_count() {
    let store = common::test_store().await;
    let a = Topic::new("window.a").unwrap();
    let b = Topic::new("window.b").unwrap();
    let c = Topic::new("window.c").unwrap();
    park_many(&store.prefix, a.as_str(), "a", 5, 1_000);
    park_many(&store.prefix, b.as_str(), "b", 3, 2_000);
    let window = FailureWindow {
        since: 1_002,
        until: 2_001,
    };
    let moved = store
        .redrive_window_topics(&[a.clone(), b.clone(), c.clone()], window)
        .await
        .unwrap();
    assert_eq!(moved, [(a.clone(), 3), (b.clone(), 2), (c, 0)]);
    assert_eq!(store.stats(&a).await.unwrap().parked, 2);
    assert_eq!(store.stats(&b).await.unwrap().parked, 1);
}

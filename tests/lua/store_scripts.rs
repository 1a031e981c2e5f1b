//! Every script of `lua/`, through the typed `Store` and raw, against the real Redis:
//! success paths and every error or edge path the script headers promise.

use crate::common;

use std::time::Duration;

use futures_util::StreamExt;
use redis::{Commands, Value};
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{
    Applied, Lease, Limits, Op, PutRequest, RejectCode, Rejection, StoreError, SCRIPT_SOURCES,
};
use redisched::store::{JobState, PutStatus, ReservedJob};

use common::{raw_redis, test_store, test_store_with, DEFAULT_LIMITS};

const LONG_TTR: Duration = Duration::from_secs(60);

fn topic(name: &str) -> Topic {
    Topic::new(name).expect("valid topic")
}

fn jid(id: &str) -> JobId {
    JobId::new(id).expect("valid id")
}

fn req(topic: &Topic, id: &str, body: &[u8], due: Due, mode: PutMode) -> PutRequest {
    PutRequest {
        topic: topic.clone(),
        id: jid(id),
        body: body.to_vec(),
        meta: Vec::new(),
        due,
        mode,
    }
}

fn nx(topic: &Topic, id: &str, due: Due) -> PutRequest {
    req(topic, id, b"body", due, PutMode::Keep)
}

fn lease(topic: &Topic, job: &ReservedJob) -> Lease {
    Lease {
        topic: topic.clone(),
        id: job.id.clone(),
        token: job.token,
    }
}

fn stale(topic: &Topic, id: &str, token: u64) -> Lease {
    Lease {
        topic: topic.clone(),
        id: id.to_string(),
        token,
    }
}

fn rejection(result: Result<impl std::fmt::Debug, StoreError>) -> Rejection {
    match result {
        Err(StoreError::Rejected(rejection)) => rejection,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

type Case<'a> = (&'a str, Vec<String>, Vec<&'a [u8]>);

fn source(name: &str) -> &'static str {
    SCRIPT_SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
        .expect("script exists")
}

/// Runs a script raw (EVALSHA with fallback) with arbitrary keys and arguments.
fn raw_script(name: &str, keys: &[String], args: &[&[u8]]) -> Result<Value, StoreError> {
    let script = redis::Script::new(source(name));
    let mut inv = script.prepare_invoke();
    for key in keys {
        inv.key(key);
    }
    for arg in args {
        inv.arg(*arg);
    }
    inv.invoke::<Value>(&mut raw_redis())
        .map_err(StoreError::from)
}

fn zscore(key: &str, member: &str) -> Option<f64> {
    raw_redis().zscore(key, member).expect("ZSCORE")
}

fn hget(key: &str, field: &str) -> Option<Vec<u8>> {
    raw_redis().hget(key, field).expect("HGET")
}

// ---------------------------------------------------------------------------- put

#[tokio::test]
async fn put_schedules_relative_to_the_server_clock() {
    let store = test_store().await;
    let t = topic("put.new");
    let before = store.server_time().await.unwrap();
    let mut request = req(&t, "a", b"hello", Due::Delay(5_000), PutMode::Keep);
    request.meta = b"\x01\x02meta".to_vec();
    let outcome = store.put(request).await.unwrap();
    let after = store.server_time().await.unwrap();
    assert_eq!(outcome.status, PutStatus::Scheduled);
    assert!(
        (before + 5_000..=after + 5_000).contains(&outcome.due_at),
        "{before} {outcome:?} {after}"
    );

    let info = store.get(&t, &jid("a")).await.unwrap().expect("job exists");
    assert_eq!(info.state, JobState::Scheduled);
    assert_eq!(info.due_at, outcome.due_at);
    assert_eq!((info.attempts, info.token, info.deadline), (0, 0, None));
    assert_eq!(info.body, b"hello");
    assert_eq!(info.meta, b"\x01\x02meta");

    // The raw record format documented in lua/README.md.
    let keys = store.keys().topic(&t).0;
    let record = hget(&keys[2], "a").unwrap();
    let expected = format!("1|{}|0|0|6|\x01\x02metahello", outcome.due_at);
    assert_eq!(record, expected.as_bytes());
    assert_eq!(zscore(&keys[0], "a"), Some(outcome.due_at as f64));
}

#[tokio::test]
async fn put_nx_on_a_scheduled_id_is_a_duplicate_and_changes_nothing() {
    let store = test_store().await;
    let t = topic("put.dup");
    let first = store
        .put(req(&t, "a", b"first", Due::Delay(60_000), PutMode::Keep))
        .await
        .unwrap();
    let again = store
        .put(req(&t, "a", b"second", Due::NOW, PutMode::Keep))
        .await
        .unwrap();
    assert_eq!(again.status, PutStatus::Duplicate);
    assert_eq!(again.due_at, first.due_at, "reports the existing due time");
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    assert_eq!(
        (info.body.as_slice(), info.due_at),
        (&b"first"[..], first.due_at)
    );
    assert!(store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .is_empty());
}

#[tokio::test]
async fn put_nx_on_a_reserved_id_is_a_duplicate_and_keeps_the_reservation() {
    let store = test_store().await;
    let t = topic("put.dupres");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    let batch = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    let job = &batch.jobs[0];
    let again = store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    assert_eq!(again.status, PutStatus::Duplicate);
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    assert_eq!((info.state, info.token), (JobState::Reserved, job.token));
    assert_eq!(store.release(&[lease(&t, job)]).await.unwrap(), 1);
}

#[tokio::test]
async fn put_nx_duplicate_reports_the_current_due_time_after_a_retry() {
    let store = test_store().await;
    let t = topic("put.dupretry");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    let job = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert!(store
        .retry(&lease(&t, &job), Duration::from_secs(30))
        .await
        .unwrap());
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    let dup = store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    assert_eq!(dup.status, PutStatus::Duplicate);
    assert_eq!(dup.due_at, info.due_at, "same due time as get reports");
    assert!(dup.due_at >= job.due_at + 30_000);
}

#[tokio::test]
async fn replace_while_scheduled_overwrites_body_meta_and_due_time() {
    let store = test_store().await;
    let t = topic("put.replace");
    store
        .put(req(&t, "a", b"old", Due::Delay(60_000), PutMode::Keep))
        .await
        .unwrap();
    let mut request = req(&t, "a", b"new", Due::Delay(120_000), PutMode::Replace);
    request.meta = b"m".to_vec();
    let outcome = store.put(request).await.unwrap();
    assert_eq!(outcome.status, PutStatus::Replaced);
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    assert_eq!(
        (info.state, info.due_at, info.body, info.meta),
        (
            JobState::Scheduled,
            outcome.due_at,
            b"new".to_vec(),
            b"m".to_vec()
        )
    );
    assert_eq!(
        store.list(&t, 10, 0).await.unwrap(),
        vec![("a".to_string(), outcome.due_at)]
    );
    let stats = store.stats(&t).await.unwrap();
    assert_eq!((stats.scheduled, stats.reserved, stats.records), (1, 0, 1));

    // Replace also works on an id that does not exist yet: it is a plain schedule.
    let fresh = store
        .put(req(&t, "b", b"x", Due::NOW, PutMode::Replace))
        .await
        .unwrap();
    assert_eq!(fresh.status, PutStatus::Scheduled);
}

#[tokio::test]
async fn replace_while_reserved_reschedules_and_voids_the_old_token() {
    let store = test_store().await;
    let t = topic("put.replres");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    let old = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_eq!(old.attempt, 1);

    let outcome = store
        .put(req(&t, "a", b"v2", Due::NOW, PutMode::Replace))
        .await
        .unwrap();
    assert_eq!(outcome.status, PutStatus::Replaced);
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    assert_eq!(
        (info.state, info.attempts, info.token),
        (JobState::Scheduled, 0, 0)
    );

    // The old reservation can neither release nor retry the new job.
    assert_eq!(store.release(&[lease(&t, &old)]).await.unwrap(), 0);
    assert!(!store.retry(&lease(&t, &old), Duration::ZERO).await.unwrap());
    assert_eq!(store.get(&t, &jid("a")).await.unwrap().unwrap().body, b"v2");

    // Reserved again: a fresh token, attempt 1 again, the new body.
    let new = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_ne!(new.token, old.token);
    assert_eq!((new.attempt, new.body.as_slice()), (1, &b"v2"[..]));
    assert_eq!(store.release(&[lease(&t, &old)]).await.unwrap(), 0);
    assert_eq!(store.release(&[lease(&t, &new)]).await.unwrap(), 1);
    assert_eq!(store.get(&t, &jid("a")).await.unwrap(), None);
}

#[tokio::test]
async fn binary_bodies_and_meta_round_trip_byte_for_byte() {
    let store = test_store().await;
    let t = topic("put.binary");
    let bodies: [(&str, &[u8], &[u8]); 5] = [
        ("nul", b"a\0b\0\0", b"\0"),
        ("invalid-utf8", b"\xff\xfe\xc3\x28\x80", b"\xc0\xaf"),
        ("pipes", b"|12|34|", b"5|6|"),
        ("empty", b"", b""),
        ("all-bytes", &[0u8; 0], &[0u8; 0]),
    ];
    let all: Vec<u8> = (0..=255u8).collect();
    for (id, body, meta) in bodies {
        let (body, meta) = if id == "all-bytes" {
            (&all[..], &all[..])
        } else {
            (body, meta)
        };
        let mut request = req(&t, id, body, Due::NOW, PutMode::Keep);
        request.meta = meta.to_vec();
        store.put(request).await.unwrap();
        let info = store.get(&t, &jid(id)).await.unwrap().unwrap();
        assert_eq!(
            (info.body.as_slice(), info.meta.as_slice()),
            (body, meta),
            "{id}"
        );
    }
    let batch = store.reserve(&t, LONG_TTR, 3).await.unwrap();
    let pulled = store.pull(&t, 10).await.unwrap();
    assert_eq!(batch.jobs.len() + pulled.jobs.len(), 5);
    for job in batch.jobs.iter().chain(&pulled.jobs) {
        let (_, body, meta) = bodies.iter().find(|(id, _, _)| *id == job.id).unwrap();
        let (body, meta) = if job.id == "all-bytes" {
            (&all[..], &all[..])
        } else {
            (*body, *meta)
        };
        assert_eq!(
            (job.body.as_slice(), job.meta.as_slice()),
            (body, meta),
            "{}",
            job.id
        );
    }
}

#[tokio::test]
async fn body_exactly_at_the_limit_is_stored_and_one_byte_more_is_refused() {
    let limits = Limits {
        max_body_bytes: 100,
        ..DEFAULT_LIMITS
    };
    let store = test_store_with(limits).await;
    let t = topic("put.limit");
    let ok = store
        .put(req(&t, "at", &[b'x'; 100], Due::NOW, PutMode::Keep))
        .await
        .unwrap();
    assert_eq!(ok.status, PutStatus::Scheduled);

    let err = rejection(
        store
            .put(req(&t, "over", &[b'x'; 101], Due::NOW, PutMode::Keep))
            .await,
    );
    assert_eq!(err.code, RejectCode::BodyTooLarge);
    assert!(
        err.message.contains("101") && err.message.contains("100"),
        "{err}"
    );
    assert_eq!(store.get(&t, &jid("over")).await.unwrap(), None);

    // A replace with an oversized body leaves the existing job untouched.
    let err = rejection(
        store
            .put(req(&t, "at", &[b'y'; 101], Due::NOW, PutMode::Replace))
            .await,
    );
    assert_eq!(err.code, RejectCode::BodyTooLarge);
    assert_eq!(
        store.get(&t, &jid("at")).await.unwrap().unwrap().body,
        vec![b'x'; 100]
    );
}

#[tokio::test]
async fn huge_body_over_the_default_limit_is_refused() {
    let store = test_store().await;
    let t = topic("put.huge");
    let body = vec![0xA5u8; DEFAULT_LIMITS.max_body_bytes + 1];
    let err = rejection(
        store
            .put(req(&t, "huge", &body, Due::NOW, PutMode::Keep))
            .await,
    );
    assert_eq!(err.code, RejectCode::BodyTooLarge);
    assert_eq!(err.code.as_str(), "body_too_large");
    let stats = store.stats(&t).await.unwrap();
    assert_eq!((stats.scheduled, stats.records), (0, 0));
}

#[tokio::test]
async fn delay_over_the_maximum_is_refused_never_truncated() {
    let limits = Limits {
        max_delay_ms: 10_000,
        ..DEFAULT_LIMITS
    };
    let store = test_store_with(limits).await;
    let t = topic("put.delay");
    let ok = store.put(nx(&t, "edge", Due::Delay(10_000))).await.unwrap();
    assert_eq!(ok.status, PutStatus::Scheduled);

    let err = rejection(store.put(nx(&t, "far", Due::Delay(10_001))).await);
    assert_eq!(err.code, RejectCode::DelayTooLong);
    assert!(
        err.message.contains("10001") && err.message.contains("10000"),
        "{err}"
    );

    let now = store.server_time().await.unwrap();
    let err = rejection(store.put(nx(&t, "far-at", Due::At(now + 3_600_000))).await);
    assert_eq!(err.code, RejectCode::DelayTooLong);

    // A refused replace keeps the existing job.
    let err = rejection(
        store
            .put(req(
                &t,
                "edge",
                b"new",
                Due::Delay(i64::MAX / 4),
                PutMode::Replace,
            ))
            .await,
    );
    assert_eq!(
        err.code,
        RejectCode::InvalidArgument,
        "17+ digit numbers are refused: {err}"
    );
    let err = rejection(
        store
            .put(req(
                &t,
                "edge",
                b"new",
                Due::Delay(1 << 40),
                PutMode::Replace,
            ))
            .await,
    );
    assert_eq!(err.code, RejectCode::DelayTooLong);
    let info = store.get(&t, &jid("edge")).await.unwrap().unwrap();
    assert_eq!(
        (info.body.as_slice(), info.due_at),
        (&b"body"[..], ok.due_at)
    );
    let stats = store.stats(&t).await.unwrap();
    assert_eq!(stats.records, 1);
}

#[tokio::test]
async fn a_due_time_in_the_past_or_a_negative_delay_means_now() {
    let store = test_store().await;
    let t = topic("put.past");
    let before = store.server_time().await.unwrap();
    let past = store.put(nx(&t, "past", Due::At(1_000))).await.unwrap();
    let negative = store.put(nx(&t, "neg", Due::Delay(-5_000))).await.unwrap();
    let after = store.server_time().await.unwrap();
    for outcome in [past, negative] {
        assert!(
            (before..=after).contains(&outcome.due_at),
            "{before} {outcome:?} {after}"
        );
    }
    let batch = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    assert_eq!(batch.jobs.len(), 2, "both are due at once");
}

// ------------------------------------------------------------------------ reserve

#[tokio::test]
async fn a_job_is_never_reserved_before_it_is_due_by_the_server_clock() {
    let store = test_store().await;
    let t = topic("reserve.early");
    let outcome = store.put(nx(&t, "soon", Due::Delay(150))).await.unwrap();
    let start = std::time::Instant::now();
    loop {
        let batch = store.reserve(&t, LONG_TTR, 10).await.unwrap();
        if let Some(job) = batch.jobs.first() {
            assert!(
                batch.now >= job.due_at,
                "taken at {} before due {}",
                batch.now,
                job.due_at
            );
            assert_eq!(job.due_at, outcome.due_at);
            break;
        }
        assert!(
            batch.now < outcome.due_at,
            "due at {} but not taken at {}",
            outcome.due_at,
            batch.now
        );
        assert_eq!(batch.next_due, Some(outcome.due_at));
        assert!(start.elapsed() < Duration::from_secs(5), "never became due");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn reserve_honours_the_batch_limit_and_reports_next_due() {
    let store = test_store().await;
    let t = topic("reserve.limit");
    for i in 0..7 {
        store.put(nx(&t, &format!("j{i}"), Due::NOW)).await.unwrap();
    }
    let later = store
        .put(nx(&t, "later", Due::Delay(60_000)))
        .await
        .unwrap();

    let first = store.reserve(&t, LONG_TTR, 3).await.unwrap();
    assert_eq!(first.jobs.len(), 3);
    let next = first.next_due.expect("due jobs are left");
    assert!(next <= first.now, "the earliest left is already due");

    let second = store.reserve(&t, LONG_TTR, 1000).await.unwrap();
    assert_eq!(second.jobs.len(), 4, "only the due ones");
    assert_eq!(second.next_due, Some(later.due_at));

    let mut all: Vec<&ReservedJob> = first.jobs.iter().chain(&second.jobs).collect();
    for batch in [&first.jobs, &second.jobs] {
        let order: Vec<(i64, &str)> = batch.iter().map(|j| (j.due_at, j.id.as_str())).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "earliest first");
    }
    all.sort_by_key(|j| j.token);
    let tokens: Vec<u64> = all.iter().map(|j| j.token).collect();
    let mut unique = tokens.clone();
    unique.dedup();
    assert_eq!(tokens.len(), unique.len(), "tokens are unique: {tokens:?}");
    assert!(all.iter().all(|j| j.attempt == 1 && j.token > 0));

    let stats = store.stats(&t).await.unwrap();
    assert_eq!(
        (
            stats.scheduled,
            stats.due_now,
            stats.reserved,
            stats.expired,
            stats.records
        ),
        (1, 0, 7, 0, 8)
    );
}

#[tokio::test]
async fn reservation_deadline_is_now_plus_ttr() {
    let store = test_store().await;
    let t = topic("reserve.deadline");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    let batch = store
        .reserve(&t, Duration::from_millis(45_000), 1)
        .await
        .unwrap();
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    assert_eq!(info.state, JobState::Reserved);
    assert_eq!(info.deadline, Some(batch.now + 45_000));
    assert_eq!((info.attempts, info.token), (1, batch.jobs[0].token));
}

// ------------------------------------------------------------------------ release

#[tokio::test]
async fn release_with_a_stale_token_after_requeue_and_re_reserve_deletes_nothing() {
    let store = test_store().await;
    let t = topic("release.stale");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    let first = store
        .reserve(&t, Duration::from_millis(1), 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let requeued = store.requeue(&t, 10).await.unwrap();
    assert_eq!((requeued.count, requeued.next_deadline), (1, None));

    // Requeued but not yet reserved again: the old token is already void.
    assert_eq!(store.release(&[lease(&t, &first)]).await.unwrap(), 0);
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    assert_eq!((info.state, info.attempts), (JobState::Scheduled, 1));

    let second = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_eq!(second.attempt, 2, "attempts survive a requeue");
    assert!(second.token > first.token);
    assert_eq!(store.release(&[lease(&t, &first)]).await.unwrap(), 0);
    assert_eq!(
        store.get(&t, &jid("a")).await.unwrap().unwrap().state,
        JobState::Reserved
    );
    assert_eq!(store.release(&[lease(&t, &second)]).await.unwrap(), 1);
    assert_eq!(store.get(&t, &jid("a")).await.unwrap(), None);
}

#[tokio::test]
async fn release_after_replace_or_delete_deletes_nothing() {
    let store = test_store().await;
    let t = topic("release.replace");
    store.put(nx(&t, "r", Due::NOW)).await.unwrap();
    store.put(nx(&t, "d", Due::NOW)).await.unwrap();
    let jobs = store.reserve(&t, LONG_TTR, 10).await.unwrap().jobs;
    let r = jobs.iter().find(|j| j.id == "r").unwrap();
    let d = jobs.iter().find(|j| j.id == "d").unwrap();
    store
        .put(req(&t, "r", b"v2", Due::Delay(60_000), PutMode::Replace))
        .await
        .unwrap();
    assert!(store.delete(&t, &jid("d")).await.unwrap());
    assert_eq!(
        store.release(&[lease(&t, r), lease(&t, d)]).await.unwrap(),
        0
    );
    assert_eq!(store.get(&t, &jid("r")).await.unwrap().unwrap().body, b"v2");
    // A token of 0 (never reserved, or pulled) never releases anything either.
    assert_eq!(store.release(&[stale(&t, "r", 0)]).await.unwrap(), 0);
}

#[tokio::test]
async fn release_many_leases_across_topics_in_one_call() {
    let store = test_store().await;
    let (a, b) = (topic("release.a"), topic("release.b"));
    for i in 0..5 {
        store.put(nx(&a, &format!("a{i}"), Due::NOW)).await.unwrap();
        store.put(nx(&b, &format!("b{i}"), Due::NOW)).await.unwrap();
    }
    let mut leases: Vec<Lease> = Vec::new();
    for t in [&a, &b] {
        let batch = store.reserve(t, LONG_TTR, 10).await.unwrap();
        leases.extend(batch.jobs.iter().map(|j| lease(t, j)));
    }
    leases.push(stale(&a, "missing", 99));
    leases.push(stale(&b, "b0", 0));
    assert_eq!(store.release(&leases).await.unwrap(), 10);
    assert_eq!(
        store.release(&leases).await.unwrap(),
        0,
        "releasing twice is harmless"
    );
    assert_eq!(store.release(&[]).await.unwrap(), 0);
    for t in [&a, &b] {
        assert_eq!(store.stats(t).await.unwrap().records, 0);
    }
}

// -------------------------------------------------------------------------- retry

#[tokio::test]
async fn retry_with_the_current_token_reschedules_after_the_delay() {
    let store = test_store().await;
    let t = topic("retry.good");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    let job = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    let before = store.server_time().await.unwrap();
    assert!(store
        .retry(&lease(&t, &job), Duration::from_secs(60))
        .await
        .unwrap());
    let info = store.get(&t, &jid("a")).await.unwrap().unwrap();
    assert_eq!(
        (info.state, info.attempts, info.deadline),
        (JobState::Scheduled, 1, None)
    );
    assert!(info.due_at >= before + 60_000);
    let batch = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    assert!(batch.jobs.is_empty(), "not due before the delay");
    assert_eq!(batch.next_due, Some(info.due_at));

    // The same token cannot retry (or release) twice.
    assert!(!store.retry(&lease(&t, &job), Duration::ZERO).await.unwrap());
    assert_eq!(store.release(&[lease(&t, &job)]).await.unwrap(), 0);
}

#[tokio::test]
async fn retry_with_zero_delay_is_due_at_once_and_counts_the_next_attempt() {
    let store = test_store().await;
    let t = topic("retry.zero");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    let first = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert!(store
        .retry(&lease(&t, &first), Duration::ZERO)
        .await
        .unwrap());
    let second = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert_eq!((second.attempt, second.due_at), (2, first.due_at));
    assert!(
        !store
            .retry(&lease(&t, &first), Duration::ZERO)
            .await
            .unwrap(),
        "stale token"
    );
    assert_eq!(
        store.get(&t, &jid("a")).await.unwrap().unwrap().state,
        JobState::Reserved
    );
}

#[tokio::test]
async fn retry_of_a_missing_or_never_reserved_job_does_nothing() {
    let store = test_store().await;
    let t = topic("retry.missing");
    assert!(!store
        .retry(&stale(&t, "ghost", 1), Duration::ZERO)
        .await
        .unwrap());
    let outcome = store
        .put(nx(&t, "waiting", Due::Delay(60_000)))
        .await
        .unwrap();
    assert!(!store
        .retry(&stale(&t, "waiting", 0), Duration::ZERO)
        .await
        .unwrap());
    let info = store.get(&t, &jid("waiting")).await.unwrap().unwrap();
    assert_eq!(
        (info.state, info.due_at),
        (JobState::Scheduled, outcome.due_at)
    );
}

// ------------------------------------------------------------------------ requeue

#[tokio::test]
async fn requeue_honours_its_limit_and_reports_the_next_deadline() {
    let store = test_store().await;
    let t = topic("requeue.limit");
    for i in 0..3 {
        store.put(nx(&t, &format!("x{i}"), Due::NOW)).await.unwrap();
    }
    let expiring = store
        .reserve(&t, Duration::from_millis(1), 10)
        .await
        .unwrap();
    assert_eq!(expiring.jobs.len(), 3);
    store.put(nx(&t, "keep", Due::NOW)).await.unwrap();
    let kept = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let stats = store.stats(&t).await.unwrap();
    assert_eq!((stats.reserved, stats.expired), (4, 3));

    let r1 = store.requeue(&t, 2).await.unwrap();
    assert_eq!(r1.count, 2);
    assert_eq!(
        r1.next_deadline,
        Some(expiring.now + 1),
        "one expired reservation is left"
    );
    let r2 = store.requeue(&t, 10).await.unwrap();
    assert_eq!(r2.count, 1);
    assert_eq!(r2.next_deadline, Some(kept.now + 60_000));
    let r3 = store.requeue(&t, 10).await.unwrap();
    assert_eq!((r3.count, r3.next_deadline), (0, Some(kept.now + 60_000)));

    // Requeued jobs are due now and keep their attempt count.
    let stats = store.stats(&t).await.unwrap();
    assert_eq!(
        (
            stats.scheduled,
            stats.due_now,
            stats.reserved,
            stats.records
        ),
        (3, 3, 1, 4)
    );
    let again = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    assert_eq!(again.jobs.len(), 3);
    assert!(again.jobs.iter().all(|j| j.attempt == 2));
}

// --------------------------------------------------------------------------- pull

#[tokio::test]
async fn pull_takes_due_jobs_and_deletes_them_at_once() {
    let store = test_store().await;
    let t = topic("pull.basic");
    for i in 0..3 {
        store.put(nx(&t, &format!("p{i}"), Due::NOW)).await.unwrap();
    }
    let later = store
        .put(nx(&t, "later", Due::Delay(60_000)))
        .await
        .unwrap();
    let first = store.pull(&t, 2).await.unwrap();
    assert_eq!(first.jobs.len(), 2);
    assert!(first.jobs.iter().all(|j| j.token == 0 && j.attempt == 1));
    assert!(first.next_due.unwrap() <= first.now);
    for job in &first.jobs {
        assert_eq!(
            store.get(&t, &jid(&job.id)).await.unwrap(),
            None,
            "pulled = deleted"
        );
    }
    let second = store.pull(&t, 10).await.unwrap();
    assert_eq!(second.jobs.len(), 1);
    assert_eq!(second.next_due, Some(later.due_at));
    let third = store.pull(&t, 10).await.unwrap();
    assert!(third.jobs.is_empty());
    assert_eq!(third.next_due, Some(later.due_at));
    let stats = store.stats(&t).await.unwrap();
    assert_eq!((stats.scheduled, stats.reserved, stats.records), (1, 0, 1));
}

#[tokio::test]
async fn pull_reports_the_attempt_a_requeued_job_would_have_had() {
    let store = test_store().await;
    let t = topic("pull.attempt");
    store.put(nx(&t, "a", Due::NOW)).await.unwrap();
    store
        .reserve(&t, Duration::from_millis(1), 1)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(store.requeue(&t, 10).await.unwrap().count, 1);
    let pulled = store.pull(&t, 10).await.unwrap();
    assert_eq!((pulled.jobs[0].attempt, pulled.jobs[0].token), (2, 0));
}

// ------------------------------------------------------------------ empty + inspect

#[tokio::test]
async fn every_script_on_an_empty_topic() {
    let store = test_store().await;
    let t = topic("empty");
    let batch = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    assert!(batch.jobs.is_empty() && batch.corrupt.is_empty());
    assert_eq!(batch.next_due, None);
    assert!(batch.now > 1_600_000_000_000);
    let pulled = store.pull(&t, 10).await.unwrap();
    assert!(pulled.jobs.is_empty() && pulled.next_due.is_none());
    let requeued = store.requeue(&t, 10).await.unwrap();
    assert_eq!((requeued.count, requeued.next_deadline), (0, None));
    assert_eq!(store.release(&[stale(&t, "x", 1)]).await.unwrap(), 0);
    assert!(!store
        .retry(&stale(&t, "x", 1), Duration::ZERO)
        .await
        .unwrap());
    assert!(!store.delete(&t, &jid("x")).await.unwrap());
    assert_eq!(store.get(&t, &jid("x")).await.unwrap(), None);
    assert!(store.list(&t, 10, 0).await.unwrap().is_empty());
    let stats = store.stats(&t).await.unwrap();
    assert_eq!(
        (
            stats.scheduled,
            stats.due_now,
            stats.reserved,
            stats.expired,
            stats.records
        ),
        (0, 0, 0, 0, 0)
    );
    assert!(stats.now > 1_600_000_000_000);
    // Nothing was created by looking.
    let keys: Vec<String> = raw_redis().keys(format!("{}:*", store.prefix)).unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

#[tokio::test]
async fn delete_removes_a_job_wherever_it_is() {
    let store = test_store().await;
    let t = topic("delete");
    store.put(nx(&t, "s", Due::Delay(60_000))).await.unwrap();
    store.put(nx(&t, "r", Due::NOW)).await.unwrap();
    let job = store
        .reserve(&t, LONG_TTR, 10)
        .await
        .unwrap()
        .jobs
        .remove(0);
    assert!(store.delete(&t, &jid("s")).await.unwrap());
    assert!(store.delete(&t, &jid("r")).await.unwrap());
    assert!(
        !store.delete(&t, &jid("r")).await.unwrap(),
        "second delete finds none"
    );
    assert_eq!(store.release(&[lease(&t, &job)]).await.unwrap(), 0);
    let stats = store.stats(&t).await.unwrap();
    assert_eq!((stats.scheduled, stats.reserved, stats.records), (0, 0, 0));
}

#[tokio::test]
async fn get_stats_and_list_report_each_state() {
    let store = test_store().await;
    let t = topic("inspect");
    let mut dues = Vec::new();
    for (i, delay) in [30_000, 10_000, 20_000, 40_000].into_iter().enumerate() {
        let outcome = store
            .put(nx(&t, &format!("s{i}"), Due::Delay(delay)))
            .await
            .unwrap();
        dues.push((format!("s{i}"), outcome.due_at));
    }
    store.put(nx(&t, "due", Due::NOW)).await.unwrap();
    store.put(nx(&t, "due2", Due::NOW)).await.unwrap();
    let reserved = store.reserve(&t, LONG_TTR, 1).await.unwrap().jobs.remove(0);

    let stats = store.stats(&t).await.unwrap();
    assert_eq!(
        (
            stats.scheduled,
            stats.due_now,
            stats.reserved,
            stats.expired,
            stats.records
        ),
        (5, 1, 1, 0, 6)
    );

    let listed = store.list(&t, 1000, 0).await.unwrap();
    assert_eq!(listed.len(), 5, "only scheduled jobs are listed");
    let due_times: Vec<i64> = listed.iter().map(|(_, d)| *d).collect();
    let mut sorted = due_times.clone();
    sorted.sort();
    assert_eq!(due_times, sorted, "earliest first");
    dues.sort_by_key(|(_, d)| *d);
    assert_eq!(&listed[1..], &dues[..]);
    assert_eq!(
        store.list(&t, 2, 1).await.unwrap(),
        dues[..2].to_vec(),
        "paging"
    );
    assert_eq!(store.list(&t, 2, 4).await.unwrap(), dues[3..].to_vec());
    assert!(store.list(&t, 2, 10).await.unwrap().is_empty());

    let info = store.get(&t, &jid(&reserved.id)).await.unwrap().unwrap();
    assert_eq!(
        (info.state, info.attempts, info.token),
        (JobState::Reserved, 1, reserved.token)
    );
    assert_eq!(info.due_at, reserved.due_at);
    assert!(info.deadline.is_some());
    assert_eq!(store.get(&t, &jid("nope")).await.unwrap(), None);
}

#[tokio::test]
async fn apply_runs_a_mixed_batch_in_order_and_isolates_refusals() {
    let limits = Limits {
        max_body_bytes: 10,
        ..DEFAULT_LIMITS
    };
    let store = test_store_with(limits).await;
    let (a, b) = (topic("apply.a"), topic("apply.b"));
    let ops = vec![
        Op::Put(nx(&a, "1", Due::NOW)),
        Op::Put(req(&a, "big", &[0; 11], Due::NOW, PutMode::Keep)),
        Op::Put(nx(&b, "1", Due::NOW)),
        Op::Put(nx(&a, "1", Due::NOW)),
        Op::Delete {
            topic: a.clone(),
            id: jid("1"),
        },
        Op::Delete {
            topic: a.clone(),
            id: jid("1"),
        },
        Op::Put(req(&a, "1", b"again", Due::NOW, PutMode::Replace)),
    ];
    let results = store.apply(&ops).await.unwrap();
    assert_eq!(results.len(), ops.len());
    let status = |i: usize| match &results[i] {
        Ok(Applied::Put(outcome)) => outcome.status,
        other => panic!("{i}: {other:?}"),
    };
    assert_eq!(status(0), PutStatus::Scheduled);
    assert_eq!(
        results[1].as_ref().unwrap_err().code,
        RejectCode::BodyTooLarge
    );
    assert_eq!(status(2), PutStatus::Scheduled);
    assert_eq!(status(3), PutStatus::Duplicate);
    assert_eq!(results[4], Ok(Applied::Delete { removed: true }));
    assert_eq!(results[5], Ok(Applied::Delete { removed: false }));
    assert_eq!(status(6), PutStatus::Scheduled);
    assert_eq!(store.topics().await.unwrap(), vec![a.clone(), b.clone()]);
    assert!(store.apply(&[]).await.unwrap().is_empty());
}

// --------------------------------------------------------- corrupt and foreign data

#[tokio::test]
async fn corrupt_records_give_clear_errors_and_reserve_skips_them() {
    let store = test_store().await;
    let t = topic("corrupt");
    let keys = store.keys().topic(&t).0;
    let mut raw = raw_redis();
    let _: () = raw.hset(&keys[2], "bad", "garbage").unwrap();
    let _: () = raw.zadd(&keys[0], "bad", 0).unwrap();
    let _: () = raw.zadd(&keys[0], "ghost", 0).unwrap(); // no record at all
    store.put(nx(&t, "good", Due::NOW)).await.unwrap();

    let err = rejection(store.get(&t, &jid("bad")).await);
    assert_eq!(err.code, RejectCode::CorruptRecord);
    assert!(err.message.contains("bad"), "names the job: {err}");
    let err = rejection(store.put(nx(&t, "bad", Due::NOW)).await);
    assert_eq!(err.code, RejectCode::CorruptRecord);

    let batch = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    assert_eq!(
        batch.jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
        ["good"]
    );
    let mut corrupt = batch.corrupt.clone();
    corrupt.sort();
    assert_eq!(corrupt, ["bad", "ghost"]);
    assert_eq!(
        batch.next_due, None,
        "the corrupt ids no longer block the topic"
    );
    assert_eq!(zscore(&keys[0], "bad"), None);
    assert_eq!(zscore(&keys[1], "bad"), None);
    assert_eq!(
        hget(&keys[2], "bad"),
        Some(b"garbage".to_vec()),
        "kept for inspection"
    );
    let stats = store.stats(&t).await.unwrap();
    assert_eq!(
        (stats.scheduled, stats.reserved, stats.records),
        (0, 1, 2),
        "the mismatch shows"
    );

    // A replace overwrites the damaged record: the repair path.
    let outcome = store
        .put(req(&t, "bad", b"fixed", Due::NOW, PutMode::Replace))
        .await
        .unwrap();
    assert_eq!(outcome.status, PutStatus::Replaced);
    assert_eq!(
        store.get(&t, &jid("bad")).await.unwrap().unwrap().body,
        b"fixed"
    );
}

#[tokio::test]
async fn pull_skips_and_reports_corrupt_ids_too() {
    let store = test_store().await;
    let t = topic("corrupt.pull");
    let keys = store.keys().topic(&t).0;
    let mut raw = raw_redis();
    let _: () = raw.hset(&keys[2], "bad", "1|x|0|0|0|").unwrap();
    let _: () = raw.zadd(&keys[0], "bad", 0).unwrap();
    let _: () = raw.zadd(&keys[0], "ghost", 0).unwrap();
    store.put(nx(&t, "good", Due::NOW)).await.unwrap();
    let batch = store.pull(&t, 10).await.unwrap();
    assert_eq!(batch.jobs.len(), 1);
    let mut corrupt = batch.corrupt.clone();
    corrupt.sort();
    assert_eq!(corrupt, ["bad", "ghost"]);
    assert_eq!(store.stats(&t).await.unwrap().scheduled, 0);
}

#[tokio::test]
async fn a_raw_written_non_utf8_id_is_reported_as_corrupt_without_failing_the_batch() {
    let store = test_store().await;
    let t = topic("corrupt.utf8");
    let keys = store.keys().topic(&t).0;
    let mut raw = raw_redis();
    let _: () = raw.hset(&keys[2], &b"x\xff"[..], "1|5|0|0|0|body").unwrap();
    let _: () = raw.zadd(&keys[0], &b"x\xff"[..], 0).unwrap();
    store.put(nx(&t, "good", Due::NOW)).await.unwrap();
    let batch = store.reserve(&t, LONG_TTR, 10).await.unwrap();
    assert_eq!(
        batch.jobs.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
        ["good"]
    );
    assert_eq!(batch.corrupt, ["x\u{fffd}"]);
}

#[tokio::test]
async fn a_record_in_neither_set_is_reported_as_unindexed() {
    let store = test_store().await;
    let t = topic("unindexed");
    let keys = store.keys().topic(&t).0;
    let _: () = raw_redis()
        .hset(&keys[2], "lost", "1|1234|2|7|1|mB")
        .unwrap();
    let info = store.get(&t, &jid("lost")).await.unwrap().unwrap();
    assert_eq!(info.state, JobState::Unindexed);
    assert_eq!(
        (info.due_at, info.attempts, info.token, info.deadline),
        (1234, 2, 7, None)
    );
    assert_eq!(
        (info.meta.as_slice(), info.body.as_slice()),
        (&b"m"[..], &b"B"[..])
    );
    assert!(
        store.delete(&t, &jid("lost")).await.unwrap(),
        "delete cleans it up"
    );
}

#[tokio::test]
async fn wrong_type_keys_are_refused_with_a_clear_error() {
    let store = test_store().await;
    let t = topic("wrongtype");
    let keys = store.keys().topic(&t).0;
    let _: () = raw_redis().set(&keys[0], "not a zset").unwrap();
    let err = store.put(nx(&t, "a", Due::NOW)).await.unwrap_err();
    assert!(!err.is_unavailable(), "retrying would not help: {err:?}");
    let err = rejection(Err::<(), _>(err));
    assert_eq!(err.code, RejectCode::WrongType);
    assert!(err.message.contains("wrong kind of value"), "{err}");
    assert_eq!(
        rejection(store.reserve(&t, LONG_TTR, 1).await).code,
        RejectCode::WrongType
    );
    assert_eq!(rejection(store.stats(&t).await).code, RejectCode::WrongType);
    assert_eq!(
        rejection(store.list(&t, 1, 0).await).code,
        RejectCode::WrongType
    );

    let t2 = topic("wrongtype.jobs");
    let keys2 = store.keys().topic(&t2).0;
    let _: () = raw_redis().rpush(&keys2[2], "x").unwrap();
    assert_eq!(
        rejection(store.get(&t2, &jid("a")).await).code,
        RejectCode::WrongType
    );
    assert_eq!(
        rejection(store.delete(&t2, &jid("a")).await).code,
        RejectCode::WrongType
    );
    let results = store
        .apply(&[Op::Put(nx(&t2, "a", Due::NOW))])
        .await
        .unwrap();
    assert_eq!(results[0].as_ref().unwrap_err().code, RejectCode::WrongType);
}

#[tokio::test]
async fn scripts_refuse_bad_arguments_with_invalid_argument() {
    let store = test_store().await;
    let keys = store.keys().topic(&topic("args")).0.to_vec();
    let three = keys[..3].to_vec();
    let long_id = vec![b'i'; 257];
    // (script, keys, args): every one must be refused with INVALID_ARGUMENT.
    #[rustfmt::skip]
    let cases: Vec<Case> = vec![
        ("put", three.clone(), vec![b"id", b"b", b"", b"nx", b"delay", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"", b"b", b"", b"nx", b"delay", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![&long_id, b"b", b"", b"nx", b"delay", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"bad\xff", b"b", b"", b"nx", b"delay", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"a\nb", b"b", b"", b"nx", b"delay", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"a\xc2\x85", b"b", b"", b"nx", b"delay", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"id", b"b", b"", b"upsert", b"delay", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"id", b"b", b"", b"nx", b"later", b"0", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"id", b"b", b"", b"nx", b"delay", b"soon", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"id", b"b", b"", b"nx", b"delay", b"1.5", b"1000", b"10", b""]),
        ("put", keys.clone(), vec![b"id", b"b", b"", b"nx", b"delay", b"0", b"", b"10", b""]),
        ("put", keys.clone(), vec![b"id", b"b", b"", b"nx", b"delay", b"0", b"1000"]),
        ("put", keys.clone(), vec![b"id"]),
        ("delete", keys.clone(), vec![b""]),
        ("delete", three.clone(), vec![b"id"]),
        ("reserve", keys.clone(), vec![b"0", b"10"]),
        ("reserve", keys.clone(), vec![b"1000", b"0"]),
        ("reserve", keys.clone(), vec![b"1000", b"1001"]),
        ("reserve", keys.clone(), vec![b"1000", b"2.5"]),
        ("reserve", keys.clone(), vec![b"inf", b"10"]),
        ("reserve", keys.clone(), vec![b"ten", b"10"]),
        ("reserve", three.clone(), vec![b"1000", b"10"]),
        ("pull", keys.clone(), vec![b"0"]),
        ("pull", keys.clone(), vec![b"1001"]),
        ("pull", keys.clone(), vec![]),
        ("release", keys.clone(), vec![]),
        ("release", keys.clone(), vec![b"id"]),
        ("retry", keys.clone(), vec![b"id", b"1", b"-1"]),
        ("retry", keys.clone(), vec![b"id", b"1", b"inf"]),
        ("retry", keys.clone(), vec![b"id", b"1"]),
        ("requeue", keys.clone(), vec![b"0", b""]),
        ("requeue", keys.clone(), vec![b"1001", b""]),
        ("list", keys.clone(), vec![b"0"]),
        ("list", keys.clone(), vec![b"10", b"-1"]),
        ("list", keys.clone(), vec![b"1001"]),
        ("get", three.clone(), vec![b"id"]),
        ("stats", three.clone(), vec![]),
    ];
    for (script, keys, args) in cases {
        let shown: Vec<String> = args
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        match raw_script(script, &keys, &args) {
            Err(StoreError::Rejected(r)) => {
                assert_eq!(
                    r.code,
                    RejectCode::InvalidArgument,
                    "{script} {shown:?}: {r}"
                );
                assert!(!r.message.is_empty());
            }
            other => panic!("{script} {shown:?}: expected INVALID_ARGUMENT, got {other:?}"),
        }
    }
    let count: i64 = raw_redis().exists(&keys).unwrap();
    assert_eq!(count, 0, "no refused call wrote anything");
}

#[tokio::test]
async fn put_accepts_exactly_the_ids_the_rust_job_id_accepts() {
    // put.lua checks printable ASCII in one scan and everything else byte by byte
    //; both paths must keep the JobId rule: 1..256 bytes of UTF-8 without
    // control characters (C0, DEL, C1).
    let store = test_store().await;
    let keys = store.keys().all(&topic("ids")).to_vec();
    let mut candidates: Vec<Vec<u8>> = [
        &b"job-0000000000000001"[..],
        b" ",
        b"~",
        b"a b!{}|\\",
        b"\x7f",
        b"a\x7fb",
        b"\t",
        b"a\x00",
        b"\x1b[0m",
        b"\xc2\x85",
        b"\xc2\x9f",
        b"\xc2\xa0",
        "é-日本-🦀".as_bytes(),
        b"\xe0\x80\xaf",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xc3",
        b"\xff",
    ]
    .iter()
    .map(|c| c.to_vec())
    .collect();
    candidates.push(vec![b'a'; 256]);
    candidates.push(vec![b'a'; 257]);
    candidates.push("日".repeat(85).into_bytes());
    candidates.push("日".repeat(86).into_bytes());
    for id in candidates {
        let rust = String::from_utf8(id.clone()).is_ok_and(|s| JobId::new(s).is_ok());
        let args: [&[u8]; 9] = [
            &id, b"b", b"", b"nx", b"delay", b"60000", b"100000", b"10", b"",
        ];
        let script = match raw_script("put", &keys, &args) {
            Ok(_) => true,
            Err(StoreError::Rejected(r)) if r.code == RejectCode::InvalidArgument => false,
            Err(other) => panic!("{id:?}: {other}"),
        };
        assert_eq!(script, rust, "{:?}", String::from_utf8_lossy(&id));
    }
}

#[tokio::test]
async fn a_lua_runtime_failure_is_a_rejection_not_an_outage() {
    let err = redis::Script::new("local x = nil; return x.y")
        .invoke::<Value>(&mut raw_redis())
        .map_err(StoreError::from)
        .unwrap_err();
    let err = rejection(Err::<(), _>(err));
    assert_eq!(err.code, RejectCode::ScriptError);
}

// ---------------------------------------------------------------------- Pub/Sub

#[tokio::test]
async fn put_publishes_on_the_notify_channel_when_it_becomes_the_topic_head() {
    let store = test_store().await;
    let t = topic("notify.head");
    let client = redis::Client::open(common::redis_url()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub
        .subscribe(store.keys().notify_channel())
        .await
        .unwrap();
    assert_eq!(
        store.keys().notify_channel(),
        format!("{}:notify", store.prefix)
    );
    let mut messages = pubsub.into_on_message();
    async fn recv(messages: &mut (impl futures_util::Stream<Item = redis::Msg> + Unpin)) -> String {
        let msg = tokio::time::timeout(Duration::from_secs(5), messages.next())
            .await
            .expect("a notification within 5 s")
            .expect("stream open");
        msg.get_payload::<String>().expect("text payload")
    }
    macro_rules! next {
        () => {
            recv(&mut messages)
        };
    }

    let a = store.put(nx(&t, "a", Due::Delay(60_000))).await.unwrap();
    assert_eq!(next!().await, format!("{}|notify.head", a.due_at));

    // Not the head: silent. Then an earlier job: heard. The order on the channel proves
    // the silent put published nothing.
    store.put(nx(&t, "b", Due::Delay(120_000))).await.unwrap();
    store.put(nx(&t, "dup", Due::Delay(90_000))).await.unwrap();
    store.put(nx(&t, "a", Due::NOW)).await.unwrap(); // duplicate: silent
                                                     // An empty channel argument keeps a client's put silent even as the new head.
    let keys = store.keys().topic(&t).0.to_vec();
    raw_script(
        "put",
        &keys,
        &[
            b"quiet", b"x", b"", b"nx", b"delay", b"1000", b"100000", b"100", b"",
        ],
    )
    .unwrap();
    let c = store.put(nx(&t, "c", Due::Delay(500))).await.unwrap();
    assert_eq!(next!().await, format!("{}|notify.head", c.due_at));

    // Another topic names itself.
    let other = topic("notify.other");
    let o = store
        .put(nx(&other, "x", Due::Delay(60_000)))
        .await
        .unwrap();
    assert_eq!(next!().await, format!("{}|notify.other", o.due_at));

    // A requeue tells '<now>|<topic>'.
    let t3 = topic("notify.requeue");
    let d = store.put(nx(&t3, "d", Due::NOW)).await.unwrap();
    assert_eq!(next!().await, format!("{}|notify.requeue", d.due_at));
    store
        .reserve(&t3, Duration::from_millis(1), 10)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let before = store.server_time().await.unwrap();
    assert_eq!(store.requeue(&t3, 10).await.unwrap().count, 1);
    let msg = next!().await;
    let (when, name) = msg.split_once('|').unwrap();
    assert_eq!(name, "notify.requeue");
    assert!(when.parse::<i64>().unwrap() >= before, "{msg}");
}

/// Ingest fencing: a put or delete carrying an ingest epoch older than one that already
/// wrote the topic is refused and writes nothing; a newer epoch raises the fence;
/// unfenced writes (HTTP, other clients) are not affected.
#[tokio::test]
async fn a_write_from_an_older_ingest_epoch_is_refused_and_writes_nothing() {
    use redisched::store::Command;
    let store = test_store().await;
    let t = topic("fence");
    let put = |id: &str, body: &[u8]| Command {
        op: Op::Put(req(&t, id, body, Due::Delay(60_000), PutMode::Replace)),
        schedule: None,
        jitter_ms: 0,
    };
    let delete = |id: &str| Command {
        op: Op::Delete {
            topic: t.clone(),
            id: jid(id),
        },
        schedule: None,
        jitter_ms: 0,
    };
    let old = store.next_ingest_epoch().await.unwrap();
    let new = store.next_ingest_epoch().await.unwrap();
    assert!(new > old, "epochs grow: {old} then {new}");

    let applied = store.apply_fenced(&[put("a", b"new")], new).await.unwrap();
    assert!(applied[0].is_ok(), "{applied:?}");
    // The old session's put and delete arrive late: refused, nothing written.
    let late = store
        .apply_fenced(&[put("a", b"stale"), delete("a"), put("b", b"stale")], old)
        .await
        .unwrap();
    for result in &late {
        let refused = result.as_ref().expect_err("refused");
        assert_eq!(refused.code, RejectCode::Fenced, "{refused}");
        assert!(
            refused.message.contains("newer bridge session"),
            "{refused}"
        );
    }
    let a = store.get(&t, &jid("a")).await.unwrap().expect("a kept");
    assert_eq!(a.body, b"new");
    assert!(store.get(&t, &jid("b")).await.unwrap().is_none());
    // The same epoch and newer ones are admitted; unfenced writes always are.
    let again = store.apply_fenced(&[delete("a")], new).await.unwrap();
    assert!(
        matches!(again[0], Ok(Applied::Delete { removed: true })),
        "{again:?}"
    );
    let unfenced = store.apply_commands(&[put("c", b"http")]).await.unwrap();
    assert!(unfenced[0].is_ok(), "{unfenced:?}");
    // A fence on one topic does not reach another.
    let other = topic("fence.other");
    let elsewhere = Command {
        op: Op::Put(req(&other, "a", b"x", Due::Delay(60_000), PutMode::Keep)),
        schedule: None,
        jitter_ms: 0,
    };
    let applied = store.apply_fenced(&[elsewhere], old).await.unwrap();
    assert!(applied[0].is_ok(), "{applied:?}");
}

// ----------------------------------------------------------------------- rate_limit

/// `rate_limit.lua` takes the document's bounds (`RateLimitRequest.max_per_second`,
/// 0.001..=1000000) inclusively and compares the parsed decimal: the bounds themselves
/// are stored, the nearest decimals beyond them refused with the header's error.
#[tokio::test]
async fn rate_limit_takes_its_bounds_inclusively_and_refuses_beyond_them() {
    let store = test_store().await;
    let t = topic("rate.edges");
    let keys = store.keys().limited(&t);
    for rate in ["1000000", "1000000.0", "0.001", "0.0010"] {
        raw_script("rate_limit", &keys, &[b"set", rate.as_bytes(), b"1"])
            .unwrap_or_else(|err| panic!("{rate} is within the bounds: {err}"));
        let stored: Option<Vec<u8>> = raw_redis().hget(&keys[8], "max_per_second").expect("HGET");
        assert_eq!(stored.as_deref(), Some(rate.as_bytes()));
    }
    for rate in [
        "1000000.000001",
        "1000000.0000000001",
        "0.000999999",
        "1e6",
        "-1",
        "",
    ] {
        let refused = rejection(raw_script(
            "rate_limit",
            &keys,
            &[b"set", rate.as_bytes(), b"1"],
        ));
        assert_eq!(refused.code, RejectCode::InvalidArgument, "{rate:?}");
        assert!(
            refused
                .message
                .contains("max_per_second must be a decimal 0.001..1000000"),
            "{rate:?}: {}",
            refused.message
        );
    }
}

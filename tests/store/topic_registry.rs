//! The topics set (`<prefix>:topics`): the store adds a topic once per
//! refresh time instead of once per batch, and never leaves a topic it puts to missing
//! for longer than that: a set deleted by hand is whole again at the first put after
//! the refresh, and a Redis that restarted without its data gets the topic back with
//! the first batch that meets it.

use crate::common;

use std::time::{Duration, Instant};

use common::faults::PrivateRedis;
use common::{test_store, DEFAULT_LIMITS};
use redis::AsyncCommands;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{ConnectOptions, Op, PutRequest, Store, StoreError};

fn put(topic: &Topic, id: &str) -> PutRequest {
    PutRequest {
        topic: topic.clone(),
        id: JobId::new(id).expect("valid id"),
        body: b"b".to_vec(),
        meta: Vec::new(),
        due: Due::Delay(60_000),
        mode: PutMode::Keep,
    }
}

fn sadd_calls(info: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_sadd:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

async fn private_store(redis: &PrivateRedis) -> Store {
    let options = ConnectOptions {
        url: redis.url(),
        prefix: "reg".into(),
        connect_timeout: Duration::from_secs(3),
        response_timeout: Duration::from_secs(5),
        tls_ca_file: None,
    };
    Store::connect(&options, DEFAULT_LIMITS)
        .await
        .expect("the private redis-server answers")
}

#[tokio::test]
async fn a_deleted_topics_set_is_whole_again_at_the_first_put_after_the_refresh() {
    let test = test_store().await;
    let refresh = Duration::from_secs(1);
    let store = test.store.clone().with_topic_refresh(refresh);
    let t = Topic::new("registry.refresh").expect("topic");
    let mut raw = redis::Client::open(common::redis_url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let set = store.keys().topics();

    let first = Instant::now();
    store.put(put(&t, "a")).await.expect("put a");
    assert_eq!(store.topics().await.expect("topics"), vec![t.clone()]);

    // Within the refresh time the store trusts its registration: no SADD, so a set
    // deleted meanwhile stays empty...
    let _: () = raw.del(&set).await.expect("del");
    store.put(put(&t, "b")).await.expect("put b");
    if first.elapsed() < refresh {
        assert!(
            store.topics().await.expect("topics").is_empty(),
            "a put within the refresh time registered the topic again"
        );
    }
    // ...until the first put after it.
    tokio::time::sleep(refresh).await;
    store.put(put(&t, "c")).await.expect("put c");
    assert_eq!(store.topics().await.expect("topics"), vec![t.clone()]);
    assert_eq!(store.stats(&t).await.expect("stats").scheduled, 3);
}

#[tokio::test]
async fn a_topic_is_added_once_per_refresh_not_once_per_batch() {
    // A private Redis: its command statistics are this test's alone.
    let redis = PrivateRedis::start();
    let store = private_store(&redis).await;
    let mut raw = redis::Client::open(redis.url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    let (a, b) = (
        Topic::new("a").expect("topic"),
        Topic::new("b").expect("topic"),
    );
    for n in 0..20 {
        let ops = [
            Op::Put(put(&a, &format!("a{n}"))),
            Op::Put(put(&b, &format!("b{n}"))),
        ];
        for result in store.apply(&ops).await.expect("apply") {
            result.expect("put");
        }
    }
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut raw)
        .await
        .expect("info");
    assert_eq!(sadd_calls(&info), 1, "20 batches, one SADD of both topics");
    assert_eq!(store.topics().await.expect("topics"), vec![a, b]);
}

#[tokio::test]
async fn a_redis_that_restarts_empty_gets_its_topics_back_with_the_next_put() {
    let mut redis = PrivateRedis::start();
    let store = private_store(&redis).await;
    let t = Topic::new("restart").expect("topic");
    store.put(put(&t, "before")).await.expect("put before");
    assert_eq!(store.topics().await.expect("topics"), vec![t.clone()]);

    // The store remembers registering `t` (for 10 s by default); the restarted server
    // has neither the set nor the scripts.
    redis.restart_empty();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match store.put(put(&t, "after")).await {
            Ok(_) => break,
            Err(StoreError::Unavailable(err)) if Instant::now() < deadline => {
                eprintln!("while Redis restarts: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("put after the restart: {err}"),
        }
    }
    assert_eq!(
        store.topics().await.expect("topics"),
        vec![t.clone()],
        "the put that met the empty server registered its topic again"
    );
    let stats = store.stats(&t).await.expect("stats");
    assert_eq!(stats.scheduled, 1, "only the job put after the restart");
}

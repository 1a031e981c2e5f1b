//! The Pub/Sub wake-up path survives a half-open subscription.
//!
//! With the rescan interval set long (60 s), a job that another client puts through the
//! Lua script reaches the bridge only through the notification the script publishes. The
//! TCP proxy then freezes every connection open at that moment (no FIN, no RST, no
//! bytes): the subscriber must notice by its PING going unanswered, resubscribe and
//! rescan, so the next such job is still delivered in seconds, not at the next rescan.

use crate::common;

use std::time::{Duration, Instant};

use common::bridge::*;
use common::faults::{socket_addr, Proxy};
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{PutRequest, SUBSCRIPTION_PING_INTERVAL};

const SECOND: Duration = Duration::from_secs(1);

fn put_now(topic: &str, id: &str) -> PutRequest {
    PutRequest {
        topic: Topic::new(topic).expect("topic"),
        id: JobId::new(id).expect("id"),
        body: id.as_bytes().to_vec(),
        meta: Vec::new(),
        due: Due::NOW,
        mode: PutMode::Keep,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_subscription_is_replaced_and_wake_ups_resume() {
    let _shared = common::timed::shared().await;
    let redis_proxy = Proxy::start(socket_addr(&common::redis_url())).await;
    let mut config = test_config("subscription");
    config.redis.url = redis_proxy.redis_url();
    config.redis.response_timeout_ms = 1_000;
    // Only notifications can wake the dispatcher in time: the safety-net rescan is a minute.
    config.dispatch.poll_interval_ms = 60_000;
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    // Another client of the scripts, straight to Redis (not through the proxy).
    let other = common::TestStore {
        store: common::test_store_named(&config.redis.prefix).await,
        prefix: config.redis.prefix.clone(),
    };
    let bridge = InProcess::start(&config);
    // Let the bridge subscribe and finish its first rescan.
    tokio::time::sleep(2 * SECOND).await;

    let started = Instant::now();
    other
        .store
        .put(put_now("wake", "before"))
        .await
        .expect("put");
    let (_, job) = ready
        .next(10 * SECOND)
        .await
        .expect("woken by the notification");
    assert_eq!(message_id(&job), "before");
    let before = started.elapsed();

    // Half-open: every connection open now (the subscription among them) hangs forever.
    redis_proxy.freeze_existing();
    // The subscriber needs up to one PING interval plus the response timeout to notice.
    tokio::time::sleep(SUBSCRIPTION_PING_INTERVAL + 2 * SECOND).await;
    let started = Instant::now();
    other
        .store
        .put(put_now("wake", "after"))
        .await
        .expect("put");
    let arrived = ready.next(30 * SECOND).await;
    let after = started.elapsed();
    bridge.stop().await;
    broker.cleanup().await;
    let (_, job) = arrived.expect("delivered after the subscription was replaced");
    assert_eq!(message_id(&job), "after");
    println!("[subscription] wake-up before the freeze {before:?}, after it {after:?}");
    assert!(
        after < 10 * SECOND,
        "after a half-open subscription the job waited {after:?}: the wake-up path did not recover \
         (the rescan alone would take up to 60 s)"
    );
}

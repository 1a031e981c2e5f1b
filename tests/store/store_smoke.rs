use crate::common;

use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::PutStatus;
use redisched::store::{Lease, PutRequest};
use std::time::Duration;

#[tokio::test]
async fn put_reserve_release_round_trip() {
    let store = common::test_store().await;
    let topic = Topic::new("smoke").unwrap();
    let put = |id: &str, due| PutRequest {
        topic: topic.clone(),
        id: JobId::new(id).unwrap(),
        body: b"hello\0\xff".to_vec(),
        meta: Vec::new(),
        due,
        mode: PutMode::Keep,
    };
    let outcome = store.put(put("a", Due::NOW)).await.unwrap();
    assert_eq!(outcome.status, PutStatus::Scheduled);
    assert_eq!(
        store.put(put("a", Due::NOW)).await.unwrap().status,
        PutStatus::Duplicate
    );
    store.put(put("later", Due::Delay(60_000))).await.unwrap();

    let batch = store
        .reserve(&topic, Duration::from_secs(30), 10)
        .await
        .unwrap();
    assert_eq!(batch.jobs.len(), 1);
    let job = &batch.jobs[0];
    assert_eq!(
        (job.id.as_str(), job.attempt, &job.body[..]),
        ("a", 1, &b"hello\0\xff"[..])
    );
    assert!(batch.next_due.unwrap() >= batch.now + 59_000);

    let lease = Lease {
        topic: topic.clone(),
        id: job.id.clone(),
        token: job.token,
    };
    assert_eq!(
        store.release(std::slice::from_ref(&lease)).await.unwrap(),
        1
    );
    assert_eq!(
        store.release(&[lease]).await.unwrap(),
        0,
        "second release finds nothing"
    );
    let stats = store.stats(&topic).await.unwrap();
    assert_eq!((stats.scheduled, stats.reserved, stats.records), (1, 0, 1));
    assert_eq!(store.topics().await.unwrap(), vec![topic]);
}

//! A third sink, the test's own, beside AMQP and the webhooks: proof that a sink is
//! added through the library's public API (`redisched::app::run_with`, the
//! `redisched::dispatch::Sink` trait) with no change to `dispatch/amqp/` or
//! `dispatch/webhook/`. It records each job in memory and waits for the test's verdict
//! before reporting it: jobs of its topics reach it (never the ready exchange), stay
//! reserved until it reports success and are released after; a reported failure hands
//! the job back, its error on record, and it comes again.

use crate::common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::bridge::*;
use futures_util::future::BoxFuture;
use redisched::dispatch::{Core, Round, RoundError, Sink, RESERVE_GROUP};
use redisched::job::{JobId, Topic};
use redisched::store::{JobState, Store};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

const SECOND: Duration = Duration::from_secs(1);

/// A job as it reached the sink, and where its verdict goes.
#[derive(Debug)]
struct Arrival {
    topic: String,
    id: String,
    body: Vec<u8>,
    attempt: u32,
    verdict: oneshot::Sender<Result<(), String>>,
}

/// Serves the topics under `prefix`; each job it takes goes to the test.
#[derive(Debug)]
struct Recorder {
    prefix: String,
    arrivals: mpsc::UnboundedSender<Arrival>,
}

impl Sink for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }

    fn serves(&self, topic: &Topic) -> bool {
        topic.as_str().starts_with(&self.prefix)
    }

    fn round<'a>(
        &'a self,
        due: Vec<Topic>,
        core: &'a mut Core<'_>,
    ) -> BoxFuture<'a, Result<Round, RoundError>> {
        Box::pin(async move {
            if due.is_empty() {
                return Ok(Round::Idle(HashSet::new()));
            }
            for group in due.chunks(RESERVE_GROUP) {
                for (_, jobs) in core.reserve(group, 10).await? {
                    for reserved in jobs {
                        let (verdict, decided) = oneshot::channel();
                        let arrival = Arrival {
                            topic: reserved.ticket.topic().to_string(),
                            id: reserved.job.id.clone(),
                            body: reserved.job.body.clone(),
                            attempt: reserved.ticket.attempt(),
                            verdict,
                        };
                        if self.arrivals.send(arrival).is_err() {
                            continue; // the test is over; its reservation expires
                        }
                        let settler = core.settler().clone();
                        tokio::spawn(async move {
                            match decided.await {
                                Ok(Ok(())) => settler.release(&[reserved.ticket]).await,
                                Ok(Err(reason)) => {
                                    settler.retry(&reserved.ticket, "recorder", &reason).await;
                                }
                                Err(_) => {}
                            }
                        });
                    }
                }
            }
            Ok(Round::Served)
        })
    }
}

async fn arrival(arrivals: &mut mpsc::UnboundedReceiver<Arrival>) -> Arrival {
    tokio::time::timeout(10 * SECOND, arrivals.recv())
        .await
        .expect("a job reached the third sink within 10 s")
        .expect("the sink is still running")
}

async fn job(store: &Store, topic: &str, id: &str) -> Option<redisched::store::JobInfo> {
    let (topic, id) = (Topic::new(topic).unwrap(), JobId::new(id).unwrap());
    store.get(&topic, &id).await.expect("get")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_of_the_library_users_own_gets_its_topics_and_settles_them() {
    let config = test_config("third");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let store = common::test_store_named(&config.redis.prefix).await;
    let (sent, mut arrivals) = mpsc::unbounded_channel();
    let recorder = Recorder {
        prefix: "side.".into(),
        arrivals: sent,
    };
    let shutdown = CancellationToken::new();
    let bridge = tokio::spawn(redisched::app::run_with(
        config.clone(),
        vec![Arc::new(recorder)],
        shutdown.clone(),
    ));

    broker.put("side.a", "j1", b"hello", &[]).await;
    broker.put("main", "m1", b"for amqp", &[]).await;

    // Its topic's job reaches it, and stays reserved until it reports.
    let first = arrival(&mut arrivals).await;
    assert_eq!(
        (first.topic.as_str(), first.id.as_str(), first.attempt),
        ("side.a", "j1", 1)
    );
    assert_eq!(first.body, b"hello");
    tokio::time::sleep(SECOND / 2).await;
    let held = job(&store, "side.a", "j1")
        .await
        .expect("not released before the verdict");
    assert_eq!(held.state, JobState::Reserved);

    // A failure hands it back: its error on record, and it comes again.
    first
        .verdict
        .send(Err("refused by the test".into()))
        .expect("the sink waits for the verdict");
    let again = arrival(&mut arrivals).await;
    assert_eq!((again.id.as_str(), again.attempt), ("j1", 2));
    let retried = job(&store, "side.a", "j1")
        .await
        .expect("kept after a failure");
    assert_eq!(retried.failures, 1);
    assert_eq!(
        retried.last_error.map(|e| e.reason).as_deref(),
        Some("refused by the test")
    );

    // A success releases it.
    again
        .verdict
        .send(Ok(()))
        .expect("the sink waits for the verdict");
    let deadline = Instant::now() + 10 * SECOND;
    while job(&store, "side.a", "j1").await.is_some() {
        assert!(
            Instant::now() < deadline,
            "released after the sink's success"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The AMQP sink still has the other topics; the ready exchange never saw side.a.
    let (_, delivered) = ready.next(10 * SECOND).await.expect("the AMQP job");
    assert_eq!(delivered.routing_key.as_str(), "main");
    assert!(
        ready.next(SECOND).await.is_none(),
        "nothing else on the ready exchange"
    );

    shutdown.cancel();
    let stopped = tokio::time::timeout(20 * SECOND, bridge).await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "the bridge stops cleanly: {stopped:?}"
    );
    broker.cleanup().await;
}

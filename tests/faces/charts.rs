//! `GET /v1/topics/{topic}/due-histogram` (lua/due_histogram.lua) against the real Redis:
//! jobs land in the bucket of their due time, the backlog in `due_now`, jobs beyond the
//! window in `later`, parked jobs nowhere; bad query values are refused in the user's
//! terms; a configured token guards it like every read.

use crate::common;

use std::time::Duration;

use redisched::config::Config;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::store::{Lease, PutRequest, RetryOutcome, Store};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

const HOUR: i64 = 3_600_000;

struct Server {
    base: String,
    shutdown: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn serve(store: &Store, config: Config) -> Server {
    let served = common::api::serve(store.clone(), config).await;
    Server {
        base: served.base,
        shutdown: served.shutdown,
    }
}

async fn put(store: &Store, topic: &Topic, id: &str, due: Due) -> i64 {
    store
        .put(PutRequest {
            topic: topic.clone(),
            id: JobId::new(id).unwrap(),
            body: id.as_bytes().to_vec(),
            meta: Vec::new(),
            due,
            mode: PutMode::Keep,
        })
        .await
        .unwrap()
        .due_at
}

async fn get_json(url: &str, token: Option<&str>) -> (u16, Value) {
    let mut request = reqwest::Client::new().get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON body"))
}

/// Each bucket's count must equal the known jobs due in its `(from, to]`.
fn check_buckets(body: &Value, due_times: &[i64]) -> u64 {
    let buckets = body["buckets"].as_array().expect("buckets");
    let mut total = 0;
    for bucket in buckets {
        let (from, to) = (
            bucket["from"].as_i64().unwrap(),
            bucket["to"].as_i64().unwrap(),
        );
        let expected = due_times
            .iter()
            .filter(|&&due| from < due && due <= to)
            .count() as u64;
        assert_eq!(
            bucket["count"].as_u64(),
            Some(expected),
            "bucket {bucket} of {body}"
        );
        total += expected;
    }
    total
}

#[tokio::test]
async fn jobs_are_counted_in_the_bucket_of_their_due_time() {
    let store = common::test_store().await;
    let topic = Topic::new("charts.mail").unwrap();
    let mut in_hour = Vec::new();
    for (id, delay) in [
        ("a", 5 * 60_000),
        ("b", 5 * 60_000 + 10_000),
        ("c", 30 * 60_000),
        ("d", 59 * 60_000),
    ] {
        in_hour.push(put(&store, &topic, id, Due::Delay(delay)).await);
    }
    let in_day = put(&store, &topic, "e", Due::Delay(5 * HOUR)).await;
    let beyond_day = put(&store, &topic, "f", Due::Delay(30 * HOUR)).await;
    // Park one job: reserve it (the only one due), fail it with max_attempts 1.
    put(&store, &topic, "parked", Due::NOW).await;
    let batch = store
        .reserve(&topic, Duration::from_secs(30), 10)
        .await
        .unwrap();
    let [parked] = &batch.jobs[..] else {
        panic!("one due job: {:?}", batch.jobs)
    };
    let lease = Lease {
        topic: topic.clone(),
        id: parked.id.clone(),
        token: parked.token,
    };
    assert_eq!(
        store
            .retry_failed(&lease, Duration::ZERO, "unroutable: NO_ROUTE", 1)
            .await
            .unwrap(),
        RetryOutcome::Parked
    );
    put(&store, &topic, "backlog", Due::NOW).await;
    let stats = store.stats(&topic).await.unwrap();
    assert_eq!(stats.parked, 1);

    let server = serve(&store, Config::default()).await;
    let url = format!("{}/v1/topics/charts.mail/due-histogram", server.base);

    // The next hour in 60 one-minute buckets (the defaults).
    let (status, hour) = get_json(&url, None).await;
    assert_eq!(status, 200, "{hour}");
    assert_eq!(hour["topic"], "charts.mail");
    assert_eq!(hour["window_ms"], HOUR);
    let buckets = hour["buckets"].as_array().unwrap();
    assert_eq!(buckets.len(), 60);
    let now = hour["now"].as_i64().unwrap();
    assert_eq!(buckets[0]["from"].as_i64(), Some(now));
    assert_eq!(buckets[59]["to"].as_i64(), Some(now + HOUR));
    assert_eq!(check_buckets(&hour, &in_hour), 4);
    assert_eq!(
        hour["due_now"], 1,
        "the backlog job; the parked one is not due"
    );
    assert_eq!(hour["later"], 2, "e and f; the parked job is in no count");
    assert_eq!(
        hour["due_now"].as_u64().unwrap() + 4 + hour["later"].as_u64().unwrap(),
        stats.scheduled,
        "due_now + buckets + later = scheduled"
    );

    // The next day in 24 hourly buckets.
    let (status, day) = get_json(&format!("{url}?window_ms=86400000&buckets=24"), None).await;
    assert_eq!(status, 200, "{day}");
    assert_eq!(day["buckets"].as_array().unwrap().len(), 24);
    let mut all_day = in_hour.clone();
    all_day.push(in_day);
    assert_eq!(check_buckets(&day, &all_day), 5);
    assert_eq!(day["later"], 1, "only f is beyond the day");
    assert!(beyond_day > day["now"].as_i64().unwrap() + 24 * HOUR);

    // Uneven slices: edges are rounded down, the last one ends exactly at the window.
    let (status, odd) = get_json(&format!("{url}?window_ms=1000&buckets=3"), None).await;
    assert_eq!(status, 200, "{odd}");
    let now = odd["now"].as_i64().unwrap();
    let edges: Vec<(i64, i64)> = odd["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["from"].as_i64().unwrap(), b["to"].as_i64().unwrap()))
        .collect();
    assert_eq!(
        edges,
        vec![
            (now, now + 333),
            (now + 333, now + 666),
            (now + 666, now + 1000)
        ]
    );

    // A topic with no jobs answers zeros.
    let (status, none) = get_json(
        &format!(
            "{}/v1/topics/charts.none/due-histogram?buckets=4",
            server.base
        ),
        None,
    )
    .await;
    assert_eq!(status, 200, "{none}");
    assert_eq!(none["due_now"], 0);
    assert_eq!(none["later"], 0);
    assert!(none["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .all(|b| b["count"] == 0));
}

#[tokio::test]
async fn bad_query_values_are_refused_in_the_users_terms() {
    let store = common::test_store().await;
    let server = serve(&store, Config::default()).await;
    let base = format!("{}/v1/topics/charts.bad/due-histogram", server.base);
    for (query, expected) in [
        (
            "window_ms=0",
            "window_ms must be an integer 1..=1000000000000, got \"0\"",
        ),
        (
            "window_ms=",
            "window_ms must be an integer 1..=1000000000000, got \"\"",
        ),
        (
            "window_ms=1000000000001",
            "window_ms must be an integer 1..=1000000000000",
        ),
        (
            "window_ms=1h",
            "window_ms must be an integer 1..=1000000000000, got \"1h\"",
        ),
        ("window_ms=-5", "window_ms must be an integer"),
        (
            "buckets=0",
            "buckets must be an integer 1..=1000, got \"0\"",
        ),
        (
            "buckets=1001",
            "buckets must be an integer 1..=1000, got \"1001\"",
        ),
        ("buckets=2.5", "buckets must be an integer 1..=1000"),
        (
            "buckets=%2B5",
            "buckets must be an integer 1..=1000, got \"+5\"",
        ),
    ] {
        let (status, body) = get_json(&format!("{base}?{query}"), None).await;
        assert_eq!(status, 400, "{query}: {body}");
        let error = body["error"].as_str().unwrap();
        assert!(error.starts_with(expected), "{query}: {error}");
    }
    let (status, body) = get_json(
        &format!("{}/v1/topics/bad%7Btopic/due-histogram", server.base),
        None,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().starts_with("bad topic"),
        "{body}"
    );
    // The widest window and the most buckets are accepted.
    let (status, body) = get_json(
        &format!("{base}?window_ms=1000000000000&buckets=1000"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["buckets"].as_array().unwrap().len(), 1000);
}

#[tokio::test]
async fn a_configured_token_guards_the_histogram_like_every_read() {
    let store = common::test_store().await;
    let topic = Topic::new("charts.guarded").unwrap();
    put(&store, &topic, "x", Due::Delay(60_000)).await;
    let mut config = Config::default();
    config.http.token = "write-secret".into();
    config.http.read_token = "read-secret".into();
    let server = serve(&store, config).await;
    let url = format!("{}/v1/topics/charts.guarded/due-histogram", server.base);
    let (status, body) = get_json(&url, None).await;
    assert_eq!(status, 401, "{body}");
    let (status, _) = get_json(&url, Some("wrong")).await;
    assert_eq!(status, 401);
    for token in ["read-secret", "write-secret"] {
        let (status, body) = get_json(&url, Some(token)).await;
        assert_eq!(status, 200, "{token}: {body}");
        let total: u64 = body["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["count"].as_u64().unwrap())
            .sum();
        assert_eq!(total, 1);
    }
    let (status, _) = get_json(&format!("{url}?access_token=read-secret"), None).await;
    assert_eq!(
        status, 200,
        "the query-parameter form, as EventSource needs"
    );
}

//! The SSRF guard of a job's own URL (`x-redisched-url`), end to end: hostile URLs sent
//! over AMQP to a real bridge, a real receiver recording every path it is asked for.
//! No request may reach a path outside the allowed prefix; a name resolving to a
//! private address is refused when the connection is made.

use crate::common;

use std::time::{Duration, Instant};

use common::bridge::*;
use common::receiver::Receiver;
use redisched::config::Config;
use redisched::job::{JobId, Topic};
use redisched::store::{JobInfo, JobState, Store};
use redisched::targets::TargetConfig;

const SECOND: Duration = Duration::from_secs(1);

fn target(name: &str, topic: &str, receiver: &Receiver, prefix: &str) -> TargetConfig {
    TargetConfig {
        name: name.into(),
        topics: vec![topic.into()],
        url: receiver.url("/default"),
        timeout_ms: 2_000,
        allowed_url_prefixes: vec![receiver.url(prefix)],
        ..TargetConfig::default()
    }
}

fn config_with(label: &str, targets: Vec<TargetConfig>) -> Config {
    let mut config = test_config(label);
    config.targets = targets;
    config.validate().expect("valid test config");
    config
}

async fn wait_for(
    store: &Store,
    topic: &str,
    id: &str,
    done: impl Fn(Option<&JobInfo>) -> bool,
) -> Option<JobInfo> {
    let (topic, id) = (Topic::new(topic).unwrap(), JobId::new(id).unwrap());
    let deadline = Instant::now() + 15 * SECOND;
    loop {
        let job = store.get(&topic, &id).await.expect("get");
        if done(job.as_ref()) {
            return job;
        }
        assert!(Instant::now() < deadline, "job never got there: {job:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The reported hole (`…/peruser/../evil/dotdot` POSTed to `/evil/dotdot`) and its
/// family: each is set aside with a reason or delivered under the prefix, and the
/// receiver never sees a path outside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_reaches_a_path_outside_the_allowed_prefix() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let mut hook = target("billing", "billing", &receiver, "/peruser/");
    // The receiver is on 127.0.0.1: this test is about paths, not addresses.
    hook.allow_private_job_urls = true;
    let config = config_with("hookdots", vec![hook]);
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    let base = receiver.url("");
    let host = base.trim_start_matches("http://").trim_end_matches('/');
    let hostile = [
        format!("{base}/peruser/../evil/dotdot"),
        format!("{base}/peruser/%2e%2e/evil/a1"),
        format!("{base}/peruser/%2E%2e/evil/a2"),
        format!("{base}/peruser/%2e%2E/evil/a3"),
        format!("{base}/peruser/./../evil/a4"),
        format!("{base}/peruser/..%2fevil/a5"),
        format!("{base}/peruser\\..\\evil\\a6"),
        format!("http://user@{host}/peruser/a7"),
        format!("http://{host}@127.0.0.2/peruser/a8"),
        format!("{base}/peruser/a9#/../../evil"),
        format!("{base}/peruser"),
        format!("{base}/peruserx/a10"),
        format!("HTTP://{host}/evil/a11"),
    ];
    // Forms that normalise to a URL under the prefix: delivered there.
    let benign = [
        format!("{base}/peruser/./b0"),
        format!("{base}/peruser/x/../b1"),
        format!("HTTP://{host}/peruser/b2"),
    ];
    for (i, url) in hostile.iter().enumerate() {
        broker
            .put(
                "billing",
                &format!("h{i}"),
                b"x",
                &[("x-redisched-url", text(url))],
            )
            .await;
    }
    for (i, url) in benign.iter().enumerate() {
        broker
            .put(
                "billing",
                &format!("b{i}"),
                b"x",
                &[("x-redisched-url", text(url))],
            )
            .await;
    }

    // Every hostile URL is set aside with its reason.
    let set_aside = invalid.collect(hostile.len(), 15 * SECOND).await;
    let mut ids: Vec<String> = set_aside.iter().map(|(_, d)| message_id(d)).collect();
    ids.sort();
    let mut expected: Vec<String> = (0..hostile.len()).map(|i| format!("h{i}")).collect();
    expected.sort();
    assert_eq!(ids, expected);
    for (_, delivery) in &set_aside {
        let reason = header_text(delivery, "x-redisched-error").unwrap_or_default();
        assert!(
            reason.contains("allowed_url_prefixes")
                || reason.contains("percent-encodes")
                || reason.contains("backslash")
                || reason.contains("user name")
                || reason.contains("fragment"),
            "{}: {reason}",
            message_id(delivery)
        );
    }
    for i in 0..benign.len() {
        wait_for(&store, "billing", &format!("b{i}"), |j| j.is_none()).await;
    }
    let mut paths: Vec<String> = receiver.received().into_iter().map(|r| r.path).collect();
    paths.sort();
    assert_eq!(paths, ["/peruser/b0", "/peruser/b1", "/peruser/b2"]);
    bridge.stop().await;
    broker.cleanup().await;
}

/// `localhost` passes ingest (a name) but resolves to a loopback address: without
/// `allow_private_job_urls` the connection is refused and the job parked with the
/// reason, nothing sent; a target that allows private URLs delivers the same URL. A
/// literal private address is refused at the door, before anything is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_a_private_address_is_refused_at_connect_time() {
    let _shared = common::timed::shared().await;
    let receiver = Receiver::start().await;
    let port = receiver.addr.port();
    let by_name = format!("http://localhost:{port}/own/");
    let mut guarded = target("guarded", "guarded", &receiver, "/own/");
    guarded.allowed_url_prefixes = vec![by_name.clone()];
    let mut open = target("open", "open", &receiver, "/own/");
    open.allowed_url_prefixes = vec![by_name.clone()];
    open.allow_private_job_urls = true;
    // Its prefix is a literal loopback address.
    let literal = target("literal", "literal", &receiver, "/own/");
    let config = config_with("hookaddr", vec![guarded, open, literal]);
    let broker = Broker::new(&config).await;
    let mut invalid = broker.consume_invalid().await;
    let bridge = InProcess::start(&config);
    let store = common::test_store_named(&config.redis.prefix).await;

    let url = format!("{by_name}hook");
    broker
        .put("guarded", "g1", b"x", &[("x-redisched-url", text(&url))])
        .await;
    broker
        .put("open", "o1", b"x", &[("x-redisched-url", text(&url))])
        .await;
    let own = receiver.url("/own/x");
    broker
        .put("literal", "l1", b"x", &[("x-redisched-url", text(&own))])
        .await;

    let set_aside = invalid.collect(1, 10 * SECOND).await;
    assert_eq!(set_aside.len(), 1);
    assert_eq!(message_id(&set_aside[0].1), "l1");
    let reason = header_text(&set_aside[0].1, "x-redisched-error").unwrap_or_default();
    assert!(
        reason.contains("names 127.0.0.1, a loopback address"),
        "{reason}"
    );

    // Parked at once (no retry can mend a refused address), with the reason.
    let parked = wait_for(&store, "guarded", "g1", |j| {
        j.is_some_and(|j| j.state == JobState::Parked)
    })
    .await
    .expect("kept");
    let reason = parked.last_error.expect("a recorded failure").reason;
    assert!(reason.contains("localhost resolves to"), "{reason}");
    assert!(reason.contains("loopback"), "{reason}");
    assert!(reason.contains("allow_private_job_urls"), "{reason}");
    assert_eq!(parked.failures, 1, "parked on its first refusal");

    wait_for(&store, "open", "o1", |j| j.is_none()).await;
    let received = receiver.received();
    assert_eq!(received.len(), 1, "only the open target's job was sent");
    assert_eq!(received[0].path, "/own/hook");
    assert_eq!(received[0].header("x-redisched-id").as_deref(), Some("o1"));
    bridge.stop().await;
    broker.cleanup().await;
}

//! The README's producer examples (Python with pika, and Rust) speak the wire contract
//! with the default names: run each against a bridge in a private vhost.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::bridge::*;

/// A throwaway RabbitMQ vhost, deleted on drop.
struct Vhost(String);

impl Vhost {
    fn new() -> Self {
        let name = common::unique("vhost");
        let ok = |args: &[&str]| {
            Command::new("rabbitmqctl")
                .args(args)
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        };
        assert!(
            ok(&["add_vhost", &name])
                && ok(&["set_permissions", "-p", &name, "guest", ".*", ".*", ".*"]),
            "rabbitmqctl could not create a vhost; is RabbitMQ running? {}",
            common::HOW_TO_START_RABBITMQ
        );
        Self(name)
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:5672/{}", self.0)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["delete_vhost", &self.0])
            .output();
    }
}

async fn check_producer(program: &str, args: &[&str]) {
    let vhost = Vhost::new();
    let mut config = redisched::config::Config::default();
    config.amqp.url = vhost.url();
    config.redis.url = common::redis_url();
    config.redis.prefix = common::unique("examples");
    config.http.enabled = false;
    config.dispatch.poll_interval_ms = 200;
    let prefix = config.redis.prefix.clone();
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("emails").await;
    let bridge = InProcess::start(&config);

    let output = Command::new(program)
        .args(args)
        .env("AMQP_URL", vhost.url())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (arrived, job) = ready
        .next(Duration::from_secs(15))
        .await
        .expect("the scheduled email arrives");
    assert_eq!(message_id(&job), "need_some_help_email_42");
    assert_eq!(job.data, b"Need some help?");
    let due = header_i64(&job, "x-redisched-due-at").expect("due header");
    assert!(arrived >= due);
    assert!(
        ready.drain(Duration::from_secs(2)).await.is_empty(),
        "the cancelled email (43) never arrives"
    );
    bridge.stop().await;
    let _ = broker.connection.close(200, "bye".into()).await;
    common::delete_prefix(&prefix);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_pika_producer_example_works() {
    let _shared = common::timed::shared().await;
    let has_pika = Command::new("python3")
        .args(["-c", "import pika"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        has_pika,
        "python3 with pika is needed: pip install pika (scripts/test.sh does it)"
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/python/producer.py");
    check_producer("python3", &[script]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_producer_example_works() {
    let _shared = common::timed::shared().await;
    // cargo builds examples for `cargo test`, next to the test binaries' deps/ folder.
    let exe = std::env::current_exe().expect("test binary path");
    let example = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("examples").join("producer"))
        .expect("target dir");
    assert!(
        example.exists(),
        "{} not built; run through `cargo test`",
        example.display()
    );
    check_producer(example.to_str().expect("utf-8 path"), &[]).await;
}

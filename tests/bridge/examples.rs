//! The producer and consumer examples in four languages (`examples/`: Rust with lapin,
//! Python with pika, Node with amqplib, shell with amqp-tools and curl), each pair run as
//! a newcomer runs them, against a bridge with this test's own names passed through the
//! examples' environment variables. Each producer puts a job, replaces it, cancels it and
//! puts a second one, waiting for the bridge's reply to each; its consumer must print the
//! second job and never the cancelled one. A missing tool fails the test with how to
//! install it (`bash scripts/producer-deps.sh` installs them all).

use crate::common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::bridge::*;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use serde_json::Value;
use tokio::sync::mpsc;

const SECOND: Duration = Duration::from_secs(1);
const TOPIC: &str = "emails";
const CANCELLED: &str = "need_some_help_email_42";
const DELIVERED: &str = "need_some_help_email_43";
const DELIVERED_BODY: &str = "Hi 43, need some help?";
const REPLACED_BODY: &str = "Hi 42, need some help? Just reply.";
const HOW_TO_INSTALL: &str = "run `bash scripts/producer-deps.sh` (scripts/test.sh does)";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Fails with how to install `program` if it does not run.
fn require(program: &str, args: &[&str], what: &str) {
    let ok = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "{what} is needed: {HOW_TO_INSTALL}");
}

/// A consumer example running in the background: its stdout lines as they come; killed
/// on drop.
struct Consumer {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
    seen: Vec<String>,
}

impl Consumer {
    fn spawn(program: &str, args: &[&str], env: &[(&str, String)]) -> Self {
        let mut child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}; {HOW_TO_INSTALL}"));
        let (tx, lines) = mpsc::unbounded_channel();
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        forward_lines(stdout, "", tx.clone());
        forward_lines(stderr, "stderr: ", tx);
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Every line printed until one contains `needle` or `within` passes.
    async fn until(&mut self, needle: &str, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        while let Ok(Some(line)) = tokio::time::timeout_at(deadline, self.lines.recv()).await {
            self.seen.push(line.clone());
            if line.contains(needle) {
                return Some(line);
            }
        }
        None
    }
}

/// Sends each line `from` prints, after `prefix`, until it closes.
fn forward_lines(
    from: impl std::io::Read + Send + 'static,
    prefix: &'static str,
    to: mpsc::UnboundedSender<String>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            if to.send(format!("{prefix}{line}")).is_err() {
                break;
            }
        }
    });
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The producer's replies, in order: (op, id, the bridge's JSON answer).
fn replies(stdout: &str) -> Vec<(String, String, Value)> {
    stdout
        .lines()
        .filter_map(|line| {
            let (head, json) = line.split_once(": ")?;
            let (op, id) = head.split_once(' ')?;
            let reply = serde_json::from_str(json).ok()?;
            Some((op.to_string(), id.to_string(), reply))
        })
        .collect()
}

/// Waits until the consumer example consumes from its queue (so its binding is in place).
async fn wait_for_consumer(broker: &Broker, queue: &str, consumer: &mut Consumer) {
    let started = Instant::now();
    loop {
        let channel = broker.connection.create_channel().await.expect("channel");
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await;
        if matches!(&declared, Ok(q) if q.consumer_count() > 0) {
            return;
        }
        if let Ok(Some(status)) = consumer.child.try_wait() {
            panic!("the consumer exited ({status}) before consuming from {queue}");
        }
        assert!(
            started.elapsed() < 30 * SECOND,
            "the consumer did not consume from {queue} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs one language's consumer, then its producer, against a fresh bridge; `prints_ids`:
/// the consumer prints `job <id> due at <ms>: <body>` (the shell's `job: <body>` only).
async fn check_examples(producer: &[&str], consumer: &[&str], prints_ids: bool) {
    let mut config = test_config("example");
    config.http.enabled = true;
    config.http.listen = format!("127.0.0.1:{}", common::faults::free_port());
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);
    let queue = common::unique("example-consumer");
    let env = [
        ("AMQP_URL", config.amqp.url.clone()),
        ("COMMANDS_EXCHANGE", config.amqp.commands_exchange.clone()),
        ("READY_EXCHANGE", config.amqp.ready_exchange.clone()),
        ("QUEUE", queue.clone()),
        ("TOPIC", TOPIC.to_string()),
        ("HTTP_URL", format!("http://{}", config.http.listen)),
    ];

    let mut consuming = Consumer::spawn(consumer[0], &consumer[1..], &env);
    wait_for_consumer(&broker, &queue, &mut consuming).await;
    let output = tokio::time::timeout(
        60 * SECOND,
        tokio::process::Command::new(producer[0])
            .args(&producer[1..])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .output(),
    )
    .await
    .expect("the producer finished within 60 s")
    .unwrap_or_else(|e| panic!("cannot run {}: {e}; {HOW_TO_INSTALL}", producer[0]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{producer:?} failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let replies = replies(&stdout);
    let got: Vec<(&str, &str, &str)> = replies
        .iter()
        .map(|(op, id, r)| (op.as_str(), id.as_str(), r["status"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        got,
        [
            ("put", CANCELLED, "scheduled"),
            ("replace", CANCELLED, "replaced"),
            ("delete", CANCELLED, "deleted"),
            ("put", DELIVERED, "scheduled"),
        ],
        "the bridge's replies, as the producer printed them:\n{stdout}"
    );
    for (_, id, reply) in &replies {
        assert_eq!(reply["id"], id.as_str(), "{reply}");
        assert_eq!(reply["topic"], TOPIC, "{reply}");
    }
    let due = |k: usize| replies[k].2["due_at"].as_i64().expect("due_at");
    // The cancelled job, had the delete not applied, was due no later than the delivered
    // one: seeing the second delivered (and a while more) shows the first never comes.
    assert!(due(1) <= due(3), "{stdout}");

    let line = consuming
        .until(DELIVERED_BODY, 15 * SECOND)
        .await
        .unwrap_or_else(|| panic!("the consumer printed {:?}", consuming.seen));
    if prints_ids {
        let expected = format!("job {DELIVERED} due at {}: {DELIVERED_BODY}", due(3));
        assert_eq!(line, expected);
    } else {
        assert_eq!(line, format!("job: {DELIVERED_BODY}"));
    }
    let (_, job) = ready
        .next(5 * SECOND)
        .await
        .expect("the job on the ready exchange");
    assert_eq!(message_id(&job), DELIVERED);
    assert_eq!(job.data, DELIVERED_BODY.as_bytes());
    assert_eq!(header_i64(&job, "x-redisched-due-at"), Some(due(3)));

    let late = ready.drain(2 * SECOND).await;
    assert!(
        late.is_empty(),
        "nothing else arrives: {:?}",
        id_counts(&late)
    );
    assert!(consuming.until("Hi 42", Duration::ZERO).await.is_none());
    assert!(
        !consuming.seen.iter().any(|l| l.contains("Hi 42")),
        "the cancelled job never arrives: {:?}",
        consuming.seen
    );
    if !prints_ids {
        // The shell producer reads the replaced job back over HTTP with curl.
        let stored = stdout
            .lines()
            .find_map(|l| l.strip_prefix("stored: "))
            .expect("the job read back with curl");
        let stored: Value = serde_json::from_str(stored).expect("JSON from the API");
        assert_eq!(stored["body"], REPLACED_BODY, "{stored}");
        assert_eq!(stored["state"], "scheduled", "{stored}");
    }

    drop(consuming);
    let _ = broker
        .channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_examples_schedule_replace_cancel_and_consume() {
    let _shared = common::timed::shared().await;
    // `cargo test` builds the examples next to the test binaries' deps/ folder.
    let dir = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("examples")))
        .expect("target dir");
    for name in ["producer", "consumer"] {
        let exe = dir.join(name);
        let built = std::fs::metadata(&exe).and_then(|m| m.modified());
        let source = std::fs::metadata(repo(&format!("examples/{name}.rs")))
            .and_then(|m| m.modified())
            .expect("example source");
        assert!(
            matches!(built, Ok(built) if built >= source),
            "{} is missing or older than its source: `cargo test` (no target flags) or \
             `cargo build --examples` builds it",
            exe.display()
        );
    }
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (producer, consumer) = (path("producer"), path("consumer"));
    check_examples(&[&producer], &[&consumer], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_examples_schedule_replace_cancel_and_consume() {
    let _shared = common::timed::shared().await;
    require("python3", &["-c", "import pika"], "python3 with pika");
    let producer = repo("examples/python/producer.py");
    let consumer = repo("examples/python/consumer.py");
    check_examples(
        &["python3", &producer.to_string_lossy()],
        &["python3", &consumer.to_string_lossy()],
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_examples_schedule_replace_cancel_and_consume() {
    let _shared = common::timed::shared().await;
    require("node", &["--version"], "Node.js");
    assert!(
        repo("examples/node/node_modules/amqplib/package.json").exists(),
        "amqplib is not installed in examples/node: {HOW_TO_INSTALL}"
    );
    let producer = repo("examples/node/producer.mjs");
    let consumer = repo("examples/node/consumer.mjs");
    check_examples(
        &["node", &producer.to_string_lossy()],
        &["node", &consumer.to_string_lossy()],
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_examples_schedule_replace_cancel_and_consume() {
    let _shared = common::timed::shared().await;
    require(
        "amqp-publish",
        &["--help"],
        "amqp-publish (Debian amqp-tools)",
    );
    require("curl", &["--version"], "curl");
    let producer = repo("examples/shell/producer.sh");
    let consumer = repo("examples/shell/consumer.sh");
    check_examples(
        &["bash", &producer.to_string_lossy()],
        &["bash", &consumer.to_string_lossy()],
        false,
    )
    .await;
}

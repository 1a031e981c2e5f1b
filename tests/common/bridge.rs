//! Running bridges in tests: in-process (fast, for behaviour) or as a child process
//! (for SIGKILL), each with its own exchange/queue names and key prefix, plus a
//! producer and a consumer speaking the wire contract with lapin.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use redisched::config::Config;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{amqp_url, delete_prefix, redis_url, unique, HOW_TO_START_RABBITMQ};

/// A configuration whose every name is unique to one test, tuned for quick tests.
pub fn test_config(label: &str) -> Config {
    let mut config = Config::default();
    redisched_testkit::isolate(&mut config, &unique(label));
    config.redis.url = redis_url();
    config.amqp.url = amqp_url();
    config.http.enabled = false;
    config.dispatch.poll_interval_ms = 250;
    config.dispatch.requeue_interval_ms = 250;
    config.dispatch.retry_min_ms = 200;
    config.dispatch.retry_max_ms = 1_000;
    config.dispatch.shutdown_grace_ms = 3_000;
    config.amqp.reconnect_min_ms = 100;
    config.amqp.reconnect_max_ms = 1_000;
    config
}

/// The env vars that make a child `redisched run` use `config`.
pub fn env_for(config: &Config) -> Vec<(String, String)> {
    config.to_env()
}

/// A bridge running inside the test process.
pub struct InProcess {
    pub shutdown: CancellationToken,
    pub handle: tokio::task::JoinHandle<Result<(), redisched::app::AppError>>,
}

impl InProcess {
    pub fn start(config: &Config) -> Self {
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(redisched::app::run(config.clone(), shutdown.clone()));
        Self { shutdown, handle }
    }

    /// Graceful stop; returns how long it took.
    pub async fn stop(self) -> Duration {
        let started = Instant::now();
        self.shutdown.cancel();
        match tokio::time::timeout(Duration::from_secs(20), self.handle).await {
            Ok(Ok(Ok(()))) => {}
            other => panic!("bridge did not stop cleanly: {other:?}"),
        }
        started.elapsed()
    }
}

/// A `redisched run` child process of this build (testkit's, started the tests' way).
pub struct ChildBridge(pub redisched_testkit::ChildBridge);

impl ChildBridge {
    /// Starts the bridge with `config`, its output discarded.
    pub fn start(config: &Config) -> Self {
        Self::start_logging(config, Stdio::null(), Stdio::null())
    }

    pub fn start_logging(config: &Config, stdout: Stdio, stderr: Stdio) -> Self {
        let bin = Path::new(env!("CARGO_BIN_EXE_redisched"));
        let bridge = redisched_testkit::ChildBridge::spawn(bin, config, stdout, stderr)
            .expect("spawn redisched run");
        Self(bridge)
    }

    /// SIGTERM and wait for the exit (a minute at most); the status and how long it took.
    pub fn terminate(&mut self) -> (std::process::ExitStatus, Duration) {
        self.0
            .terminate(Duration::from_secs(60))
            .expect("signal the bridge")
            .expect("the bridge did not stop within 60 s of SIGTERM")
    }
}

impl std::ops::Deref for ChildBridge {
    type Target = redisched_testkit::ChildBridge;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for ChildBridge {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

pub async fn connect() -> Connection {
    connect_to(&amqp_url()).await
}

pub async fn connect_to(url: &str) -> Connection {
    match Connection::connect(url, ConnectionProperties::default()).await {
        Ok(c) => c,
        Err(e) => panic!("cannot reach RabbitMQ at {url}: {e}\n{HOW_TO_START_RABBITMQ}"),
    }
}

/// The producer's and consumer's side of the wire contract, plus cleanup of every
/// name the test's config uses.
pub struct Broker {
    pub config: Config,
    pub connection: Connection,
    pub channel: Channel,
}

impl Broker {
    /// Connects and declares the same topology the bridge does, so a test can publish
    /// before the bridge is up.
    pub async fn new(config: &Config) -> Self {
        Self::over(config, connect_to(&config.amqp.url).await).await
    }

    /// As [`Broker::new`], over a connection the test opened itself (e.g. with TLS).
    pub async fn over(config: &Config, connection: Connection) -> Self {
        let channel = connection.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        redisched::amqp::declare_topology(&channel, &config.amqp)
            .await
            .expect("declare topology");
        Self {
            config: config.clone(),
            connection,
            channel,
        }
    }

    /// Publishes a command and waits for the broker's confirm, republishing it if the
    /// broker nacks it, as a producer using confirms must: a nack means the broker did
    /// not take the command. RabbitMQ 3.10 was seen to nack one publish among hundreds
    /// while a bridge connected and declared a new quorum commands queue (cause inside
    /// the broker not found); each republish is printed, and more than a few fail.
    pub async fn command(&self, topic: &str, props: BasicProperties, body: &[u8]) {
        const ATTEMPTS: usize = 4;
        for attempt in 1..=ATTEMPTS {
            let confirm = self
                .channel
                .basic_publish(
                    self.config.amqp.commands_exchange.as_str().into(),
                    topic.into(),
                    BasicPublishOptions::default(),
                    body,
                    props.clone(),
                )
                .await
                .expect("publish command")
                .await
                .expect("confirm");
            if confirm.is_ack() {
                return;
            }
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            assert!(
                attempt < ATTEMPTS,
                "command not confirmed: the broker nacked it {ATTEMPTS} times (last at {at:?} since the epoch)"
            );
            eprintln!(
                "the broker nacked a command (topic {topic}, message_id {:?}) at {at:?} since the epoch; publishing it again",
                props.message_id()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn put(&self, topic: &str, id: &str, body: &[u8], headers: &[(&str, AMQPValue)]) {
        self.command(topic, props(id, headers), body).await;
    }

    /// A consumer of the ready exchange for `binding` (routing key pattern).
    pub async fn consume_ready(&self, binding: &str) -> Receiver {
        self.consume_exchange(&self.config.amqp.ready_exchange.clone(), binding)
            .await
    }

    /// A consumer of the invalid queue the bridge declared.
    pub async fn consume_invalid(&self) -> Receiver {
        let queue = self.config.amqp.invalid_queue.clone();
        self.consume_queue(&queue).await
    }

    pub async fn consume_exchange(&self, exchange: &str, binding: &str) -> Receiver {
        let (channel, queue) = self.bound_queue(exchange, binding).await;
        self.consume_on(channel, &queue).await
    }

    /// A channel and an exclusive queue on it, bound to `exchange` with `binding`.
    async fn bound_queue(&self, exchange: &str, binding: &str) -> (Channel, String) {
        let queue = unique("q");
        let channel = self.connection.create_channel().await.expect("channel");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare consumer queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind consumer queue");
        (channel, queue)
    }

    /// A consumer of the ready exchange for `binding` that stamps each delivery (local
    /// epoch ms, the clock Redis uses on this host) the moment it arrives, before any ack
    /// round trip (auto-ack): for measuring lateness against the due time.
    pub async fn consume_ready_stamped(
        &self,
        binding: &str,
    ) -> mpsc::UnboundedReceiver<(i64, Delivery)> {
        let ready = self.config.amqp.ready_exchange.clone();
        let (channel, queue) = self.bound_queue(&ready, binding).await;
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                if tx.send((now_ms(), delivery)).is_err() {
                    break;
                }
            }
            drop(channel);
        });
        rx
    }

    pub async fn consume_queue(&self, queue: &str) -> Receiver {
        let channel = self.connection.create_channel().await.expect("channel");
        self.consume_on(channel, queue).await
    }

    async fn consume_on(&self, channel: Channel, queue: &str) -> Receiver {
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let _ = delivery.ack(BasicAckOptions::default()).await;
                if tx.send((now_ms(), delivery)).is_err() {
                    break;
                }
            }
            drop(channel);
        });
        Receiver { rx }
    }

    /// Deletes every exchange and queue of the config, and its Redis keys.
    pub async fn cleanup(self) {
        let a = &self.config.amqp;
        let mut queues = vec![
            a.commands_queue.clone(),
            a.invalid_queue.clone(),
            a.expired_queue.clone(),
        ];
        // Command partitions of this or an earlier configuration of the test.
        queues.extend(
            (0..a.command_partitions.max(16)).map(|k| redisched::amqp::partition_queue(a, k)),
        );
        queues.push(redisched::amqp::route_queue(a));
        for queue in &queues {
            let _ = self
                .channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let mut exchanges = vec![
            a.commands_exchange.clone(),
            a.invalid_exchange.clone(),
            a.expired_exchange.clone(),
            a.ready_exchange.clone(),
            redisched::amqp::hash_exchange(a),
        ];
        exchanges.extend(
            (0..a.command_partitions.max(16)).map(|k| redisched::amqp::partition_exchange(a, k)),
        );
        for exchange in &exchanges {
            let _ = self
                .channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.connection.close(200, "bye".into()).await;
        delete_prefix(&self.config.redis.prefix);
    }

    pub async fn declare_queue(&self, queue: &str) {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare queue");
    }

    pub fn exchange_kind() -> ExchangeKind {
        ExchangeKind::Topic
    }
}

pub struct Receiver {
    rx: mpsc::UnboundedReceiver<(i64, Delivery)>,
}

impl Receiver {
    /// The next delivery within `timeout`, with its arrival time (epoch ms).
    pub async fn next(&mut self, timeout: Duration) -> Option<(i64, Delivery)> {
        tokio::time::timeout(timeout, self.rx.recv())
            .await
            .ok()
            .flatten()
    }

    /// Collects deliveries until `count` arrived or `timeout` passed.
    pub async fn collect(&mut self, count: usize, timeout: Duration) -> Vec<(i64, Delivery)> {
        let deadline = Instant::now() + timeout;
        let mut got = Vec::new();
        while got.len() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left).await {
                Some(d) => got.push(d),
                None => break,
            }
        }
        got
    }

    /// Deliveries arriving within `window` (to prove that nothing more comes).
    pub async fn drain(&mut self, window: Duration) -> Vec<(i64, Delivery)> {
        let mut got = Vec::new();
        while let Some(d) = self.next(window).await {
            got.push(d);
        }
        got
    }
}

pub fn props(id: &str, headers: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        table.insert((*k).into(), v.clone());
    }
    BasicProperties::default()
        .with_message_id(id.into())
        .with_headers(table)
}

pub fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn header<'a>(delivery: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
    delivery.properties.headers().as_ref()?.inner().get(name)
}

pub fn header_i64(delivery: &Delivery, name: &str) -> Option<i64> {
    match header(delivery, name)? {
        AMQPValue::LongLongInt(v) => Some(*v),
        AMQPValue::LongInt(v) => Some(i64::from(*v)),
        _ => None,
    }
}

pub fn header_text(delivery: &Delivery, name: &str) -> Option<String> {
    match header(delivery, name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

pub fn message_id(delivery: &Delivery) -> String {
    delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default()
}

/// Counts of each message id among deliveries.
pub fn id_counts(deliveries: &[(i64, Delivery)]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for (_, d) in deliveries {
        *counts.entry(message_id(d)).or_insert(0) += 1;
    }
    counts
}

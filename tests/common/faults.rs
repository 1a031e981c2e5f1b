//! Fault injection for `tests/faults.rs`, without touching the shared services:
//! a private `redis-server` and a private RabbitMQ node the test owns (killed, restarted,
//! alarmed at will), a TCP proxy that cuts or hangs connections, a reconnecting
//! producer that records which commands the broker confirmed, a reconnecting consumer
//! of the ready exchange on a durable queue, and the check that nothing accepted was
//! lost or delivered early.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use rand::Rng;
use redisched::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::bridge::{env_for, header_i64, message_id, now_ms, text, ChildBridge};
use super::unique;

/// Logs of in-process bridges, captured per test (shown for failing tests or with
/// `--nocapture`). `REDISCHED_TEST_LOG` overrides the filter.
pub fn init_logging() {
    let filter =
        std::env::var("REDISCHED_TEST_LOG").unwrap_or_else(|_| "redisched=info,lapin=error".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_test_writer()
        .try_init();
}

/// A directory removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(unique(label));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port nothing listens on right now (the kernel picks it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A free port in `range`: RabbitMQ's CLI tools derive their own port from the
/// distribution port + 10000, so the node's ports must stay well below 55535.
fn free_port_in(range: std::ops::Range<u16>) -> u16 {
    let mut rng = rand::rng();
    for _ in 0..200 {
        let port = rng.random_range(range.clone());
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {range:?}");
}

/// The last `lines` lines of a log file, for failure messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------------
// Private Redis

/// A `redis-server` child on its own port with AOF `appendfsync always`: what it
/// acknowledged survives a SIGKILL. Killed on drop.
pub struct PrivateRedis {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl PrivateRedis {
    pub fn start() -> Self {
        let mut redis = Self {
            port: free_port(),
            dir: TempDir::new("redis"),
            child: None,
        };
        redis.spawn();
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn spawn(&mut self) {
        let dir = self.dir.path();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (is it installed?)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "private redis-server did not answer:\n{}",
            tail(&dir.join("redis.log"), 20)
        );
    }

    /// `PING` answered `PONG` (not `LOADING`).
    pub fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
            return false;
        };
        redis::cmd("PING")
            .query::<String>(&mut conn)
            .is_ok_and(|p| p == "PONG")
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL on unix
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and directory (replaying the AOF).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill9();
    }
}

// ---------------------------------------------------------------------------------
// Private RabbitMQ node

fn rabbit_tool(name: &str) -> PathBuf {
    // As root, /usr/sbin/rabbitmq-* switch to the `rabbitmq` user (who could not write
    // our temp dir); the real scripts live here on Debian. Elsewhere: from PATH.
    let debian = Path::new("/usr/lib/rabbitmq/bin").join(name);
    if debian.exists() {
        debian
    } else {
        PathBuf::from(name)
    }
}

/// A second RabbitMQ node (`rs<unique>@localhost`) with its own ports, data, logs and
/// Erlang cookie (HOME is its temp dir), no plugins. Stopped and removed on drop.
pub struct PrivateRabbit {
    pub node: String,
    pub port: u16,
    dist_port: u16,
    dir: TempDir,
    child: Option<Child>,
    /// From spawn until `await_startup` succeeded.
    pub started_in: Duration,
}

impl PrivateRabbit {
    pub fn start() -> Result<Self, String> {
        Self::start_with_cookie(None)
    }

    /// As [`start`](Self::start), with `cookie` written to the node's `.erlang.cookie`
    /// first: nodes (and their CLI tools) sharing a cookie can form a cluster.
    pub fn start_with_cookie(cookie: Option<&str>) -> Result<Self, String> {
        Self::start_configured(cookie, |_| String::new())
    }

    /// Starts a node whose `rabbitmq.conf` gets the lines `extra_conf(port)` returns
    /// (e.g. a TLS listener on the node's port in place of the plain one).
    pub fn start_configured(
        cookie: Option<&str>,
        extra_conf: impl FnOnce(u16) -> String,
    ) -> Result<Self, String> {
        static NODES: AtomicU64 = AtomicU64::new(0);
        let node = format!(
            "rs{}n{}t{}@localhost",
            std::process::id(),
            NODES.fetch_add(1, Ordering::Relaxed),
            now_ms() % 1_000_000
        );
        let dir = TempDir::new("rabbit");
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").map_err(|e| e.to_string())?;
        if let Some(cookie) = cookie {
            use std::os::unix::fs::PermissionsExt;
            let path = dir.path().join(".erlang.cookie");
            std::fs::write(&path, cookie).map_err(|e| e.to_string())?;
            // Erlang refuses a cookie file others can read.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400))
                .map_err(|e| e.to_string())?;
        }
        let port = free_port_in(20_000..30_000);
        let mut dist_port = free_port_in(30_000..40_000);
        while dist_port == port {
            dist_port = free_port_in(30_000..40_000);
        }
        let conf = format!("log.console = false\n{}", extra_conf(port));
        std::fs::write(dir.path().join("rabbitmq.conf"), conf).map_err(|e| e.to_string())?;
        let mut rabbit = Self {
            node,
            port,
            dist_port,
            dir,
            child: None,
            started_in: Duration::ZERO,
        };
        let started = Instant::now();
        let out = std::fs::File::create(rabbit.dir.path().join("server.out"))
            .map_err(|e| e.to_string())?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut command = Command::new(rabbit_tool("rabbitmq-server"));
        rabbit.env(&mut command);
        let child = command
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start rabbitmq-server: {e}"))?;
        rabbit.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", rabbit.port)).is_ok() {
                break;
            }
            if let Some(Ok(Some(status))) = rabbit.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!(
                    "rabbitmq-server exited with {status}:\n{}",
                    rabbit.server_log()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "private node did not listen within 120 s:\n{}",
                    rabbit.server_log()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        rabbit.ctl(&["await_startup"])?;
        rabbit.started_in = started.elapsed();
        Ok(rabbit)
    }

    fn env(&self, command: &mut Command) {
        let dir = self.dir.path();
        command
            .env("HOME", dir)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"));
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn server_log(&self) -> String {
        tail(&self.dir.path().join("server.out"), 30)
    }

    /// `rabbitmqctl -n <node> <args>`; Err with its output when it fails.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let mut command = Command::new(rabbit_tool("rabbitmqctl"));
        self.env(&mut command);
        let output = command
            .args(["-n", &self.node, "-t", "60"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run rabbitmqctl: {e}"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if output.status.success() {
            Ok(text)
        } else {
            Err(format!("rabbitmqctl {args:?} failed: {text}"))
        }
    }

    pub fn ctl_ok(&self, args: &[&str]) {
        if let Err(err) = self.ctl(args) {
            panic!("{err}");
        }
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let _ = self.ctl(&["stop"]);
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(15);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------
// TCP proxy

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    /// New connections are accepted and closed at once.
    Refuse,
    /// Nothing is forwarded: bytes wait in the proxy, connections hang.
    Hold,
}

#[derive(Debug, Clone, Copy)]
struct State {
    mode: Mode,
    /// Connections are numbered by the epoch they were accepted in.
    epoch: u64,
    /// Connections of an epoch below this are closed.
    cut_below: u64,
    /// Connections of an epoch below this never forward again (a half-open TCP
    /// connection: no FIN, no RST, no bytes), but stay open.
    frozen_below: u64,
}

/// A TCP proxy 127.0.0.1:<any> -> `target` whose connections can be cut or hung.
pub struct Proxy {
    pub addr: SocketAddr,
    state: watch::Sender<State>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let (state, rx) = watch::channel(State {
            mode: Mode::Pass,
            epoch: 0,
            cut_below: 0,
            frozen_below: 0,
        });
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let st = *rx.borrow();
                if st.mode == Mode::Refuse {
                    drop(inbound);
                    continue;
                }
                tokio::spawn(serve(inbound, target, rx.clone(), st.epoch));
            }
        });
        Self {
            addr,
            state,
            accept,
        }
    }

    /// Closes every connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.state.send_modify(|s| {
            s.epoch += 1;
            s.cut_below = s.epoch;
            s.mode = Mode::Refuse;
        });
    }

    /// Stops forwarding on every connection, old and new, until [`Proxy::restore`].
    pub fn hold(&self) {
        self.state.send_modify(|s| s.mode = Mode::Hold);
    }

    /// The connections open now hang forever (half-open); new ones work.
    pub fn freeze_existing(&self) {
        self.state.send_modify(|s| {
            s.epoch += 1;
            s.frozen_below = s.epoch;
            s.mode = Mode::Pass;
        });
    }

    pub fn restore(&self) {
        self.state.send_modify(|s| s.mode = Mode::Pass);
    }

    pub fn redis_url(&self) -> String {
        format!("redis://{}/0", self.addr)
    }

    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Dropping the sender ends every connection task.
        self.state.send_modify(|s| {
            s.cut_below = u64::MAX;
        });
    }
}

enum Gate {
    Open,
    Closed,
}

/// Waits until this connection may forward bytes; `Closed` if it must end.
async fn gate(rx: &mut watch::Receiver<State>, epoch: u64) -> Gate {
    loop {
        let st = *rx.borrow_and_update();
        if epoch < st.cut_below {
            return Gate::Closed;
        }
        let frozen = epoch < st.frozen_below;
        if !frozen && st.mode == Mode::Pass {
            return Gate::Open;
        }
        if rx.changed().await.is_err() {
            return Gate::Closed;
        }
    }
}

async fn serve(inbound: TcpStream, target: SocketAddr, mut rx: watch::Receiver<State>, epoch: u64) {
    // A held proxy does not even connect upstream: the client's handshake hangs.
    if let Gate::Closed = gate(&mut rx, epoch).await {
        return;
    }
    let Ok(outbound) = TcpStream::connect(target).await else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    tokio::join!(
        pump(in_read, out_write, rx.clone(), epoch),
        pump(out_read, in_write, rx, epoch)
    );
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut rx: watch::Receiver<State>,
    epoch: u64,
) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        if let Gate::Closed = gate(&mut rx, epoch).await {
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
        };
        // Bytes read just before a hold wait in the proxy until it lifts.
        if let Gate::Closed = gate(&mut rx, epoch).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------
// Producer and consumer

/// What the broker confirmed: puts that must be delivered, and far-future puts whose
/// delete was confirmed, which must never be.
#[derive(Default)]
pub struct Ledger {
    /// id -> (epoch ms just before the publish, delay ms)
    pub accepted: HashMap<String, (i64, i64)>,
    pub deleted: HashSet<String>,
    /// Publishes the broker did not confirm (connection lost, nack, timeout).
    pub unconfirmed: usize,
}

pub fn topic_of(n: u64) -> String {
    format!("f.{}", n % 4)
}

/// Publishes commands to the commands exchange (persistent, confirmed), reconnecting
/// when the broker goes away, and records what was confirmed.
pub struct Producer {
    url: String,
    config: Config,
    link: Option<(Connection, Channel)>,
    next: u64,
    pub ledger: Arc<Mutex<Ledger>>,
}

/// One command of a batch.
enum Cmd {
    Put {
        id: String,
        topic: String,
        delay: i64,
    },
    Delete {
        id: String,
        topic: String,
    },
}

impl Producer {
    pub fn new(url: &str, config: &Config) -> Self {
        Self {
            url: url.to_string(),
            config: config.clone(),
            link: None,
            next: 0,
            ledger: Arc::default(),
        }
    }

    async fn channel(&mut self) -> Option<Channel> {
        if let Some((conn, channel)) = &self.link {
            if conn.status().connected() && channel.status().connected() {
                return Some(channel.clone());
            }
        }
        self.link = None;
        let open = async {
            let conn = Connection::connect(&self.url, ConnectionProperties::default()).await?;
            let channel = conn.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            redisched::amqp::declare_topology(&channel, &self.config.amqp).await?;
            Ok::<_, lapin::Error>((conn, channel))
        };
        match tokio::time::timeout(Duration::from_secs(5), open).await {
            Ok(Ok((conn, channel))) => {
                self.link = Some((conn, channel.clone()));
                Some(channel)
            }
            _ => None,
        }
    }

    /// Publishes `near` puts due within `max_delay_ms`, plus `cancels` far-future puts
    /// each followed by its delete; waits for the confirms. Returns how many of the
    /// near puts were confirmed.
    pub async fn batch(&mut self, near: usize, max_delay_ms: i64, cancels: usize) -> usize {
        let mut cmds = Vec::new();
        for _ in 0..near {
            let n = self.next;
            self.next += 1;
            // ThreadRng is not Send: never held across an await.
            let delay = if max_delay_ms > 0 {
                rand::rng().random_range(0..=max_delay_ms)
            } else {
                0
            };
            cmds.push(Cmd::Put {
                id: format!("j{n}"),
                topic: topic_of(n),
                delay,
            });
        }
        for _ in 0..cancels {
            let n = self.next;
            self.next += 1;
            let (id, topic) = (format!("c{n}"), topic_of(n));
            cmds.push(Cmd::Put {
                id: id.clone(),
                topic: topic.clone(),
                delay: 600_000,
            });
            cmds.push(Cmd::Delete { id, topic });
        }
        self.publish(cmds).await
    }

    async fn publish(&mut self, cmds: Vec<Cmd>) -> usize {
        let total = cmds.len();
        let Some(channel) = self.channel().await else {
            self.ledger.lock().unwrap().unconfirmed += total;
            return 0;
        };
        let exchange = self.config.amqp.commands_exchange.clone();
        let work = async {
            let mut pending = Vec::new();
            for cmd in cmds {
                let (topic, props, sent) = match &cmd {
                    Cmd::Put { id, topic, delay } => {
                        let mut headers = FieldTable::default();
                        headers.insert("x-delay".into(), AMQPValue::LongLongInt(*delay));
                        let props = BasicProperties::default()
                            .with_message_id(id.as_str().into())
                            .with_delivery_mode(2)
                            .with_headers(headers);
                        (topic.clone(), props, now_ms())
                    }
                    Cmd::Delete { id, topic } => {
                        let mut headers = FieldTable::default();
                        headers.insert("x-redisched-op".into(), text("delete"));
                        let props = BasicProperties::default()
                            .with_message_id(id.as_str().into())
                            .with_delivery_mode(2)
                            .with_headers(headers);
                        (topic.clone(), props, now_ms())
                    }
                };
                let confirm = channel
                    .basic_publish(
                        exchange.as_str().into(),
                        topic.as_str().into(),
                        BasicPublishOptions::default(),
                        b"x",
                        props,
                    )
                    .await?;
                pending.push((cmd, sent, confirm));
            }
            let mut settled = Vec::new();
            for (cmd, sent, confirm) in pending {
                let acked = matches!(confirm.await, Ok(c) if c.is_ack());
                settled.push((cmd, sent, acked));
            }
            Ok::<_, lapin::Error>(settled)
        };
        let settled = match tokio::time::timeout(Duration::from_secs(10), work).await {
            Ok(Ok(settled)) => settled,
            _ => {
                // Unknown fate: none counts as accepted; start over on a new connection.
                self.link = None;
                self.ledger.lock().unwrap().unconfirmed += total;
                return 0;
            }
        };
        let mut ledger = self.ledger.lock().unwrap();
        let mut near_ok = 0;
        for (cmd, sent, acked) in settled {
            match (cmd, acked) {
                (Cmd::Put { id, delay, .. }, true) => {
                    if !id.starts_with('c') {
                        near_ok += 1;
                        ledger.accepted.insert(id, (sent, delay));
                    }
                }
                (Cmd::Delete { id, .. }, true) => {
                    ledger.deleted.insert(id);
                }
                (_, false) => ledger.unconfirmed += 1,
            }
        }
        near_ok
    }

    pub async fn close(&mut self) {
        if let Some((conn, _)) = self.link.take() {
            let _ =
                tokio::time::timeout(Duration::from_secs(3), conn.close(200, "bye".into())).await;
        }
    }
}

/// Runs a steady load until `stop`: batches of `per_batch` puts due within
/// `max_delay_ms` and one cancelled far-future job, every `pause`.
pub fn spawn_load(
    mut producer: Producer,
    per_batch: usize,
    max_delay_ms: i64,
    pause: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<Producer> {
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            producer.batch(per_batch, max_delay_ms, 1).await;
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(pause) => {}
            }
        }
        producer
    })
}

#[derive(Debug, Clone)]
pub struct Seen {
    pub at: i64,
    pub id: String,
    pub due_at: Option<i64>,
    pub redelivered: bool,
}

/// Consumes the ready exchange (`#`) through a durable queue, so deliveries survive a
/// broker restart; reconnects on its own.
pub struct Collector {
    pub seen: Arc<Mutex<Vec<Seen>>>,
    url: String,
    queue: String,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    pub async fn start(url: &str, config: &Config) -> Self {
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let queue = format!("{}.collector", config.redis.prefix);
        let stop = CancellationToken::new();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(collect(
            url.to_string(),
            config.clone(),
            queue.clone(),
            seen.clone(),
            stop.clone(),
            ready_tx,
        ));
        tokio::time::timeout(Duration::from_secs(30), ready_rx)
            .await
            .expect("collector consuming within 30 s")
            .expect("collector started");
        Self {
            seen,
            url: url.to_string(),
            queue,
            stop,
            task,
        }
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Deliveries that arrived at or after `since` (epoch ms).
    pub fn count_since(&self, since: i64) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.at >= since)
            .count()
    }

    /// First arrival at or after `since`, epoch ms.
    pub fn first_since(&self, since: i64) -> Option<i64> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.at)
            .filter(|&at| at >= since)
            .min()
    }

    /// Waits until every id of `ledger.accepted` arrived; true if all did.
    pub async fn wait_for_all(&self, ledger: &Ledger, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let missing = {
                let seen = self.seen.lock().unwrap();
                let ids: HashSet<&str> = seen.iter().map(|s| s.id.as_str()).collect();
                ledger
                    .accepted
                    .keys()
                    .filter(|id| !ids.contains(id.as_str()))
                    .count()
            };
            if missing == 0 {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops consuming, deletes its queue, returns everything it saw.
    pub async fn stop(self) -> Vec<Seen> {
        self.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
        if let Ok(Ok(conn)) = tokio::time::timeout(
            Duration::from_secs(5),
            Connection::connect(&self.url, ConnectionProperties::default()),
        )
        .await
        {
            if let Ok(channel) = conn.create_channel().await {
                let _ = channel
                    .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
            }
            let _ = conn.close(200, "bye".into()).await;
        }
        let seen = self.seen.lock().unwrap().clone();
        seen
    }
}

async fn collect(
    url: String,
    config: Config,
    queue: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: CancellationToken,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    while !stop.is_cancelled() {
        let open = async {
            let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
            let channel = conn.create_channel().await?;
            redisched::amqp::declare_topology(&channel, &config.amqp).await?;
            let durable = QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            channel
                .queue_declare(queue.as_str().into(), durable, FieldTable::default())
                .await?;
            channel
                .queue_bind(
                    queue.as_str().into(),
                    config.amqp.ready_exchange.as_str().into(),
                    "#".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            channel.basic_qos(2_000, BasicQosOptions::default()).await?;
            let consumer = channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok::<_, lapin::Error>((conn, channel, consumer))
        };
        let (conn, _channel, mut consumer) =
            match tokio::time::timeout(Duration::from_secs(5), open).await {
                Ok(Ok(link)) => link,
                _ => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
        if let Some(tx) = ready.take() {
            let _ = tx.send(());
        }
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => break,
                next = consumer.next() => next,
            };
            let Some(Ok(delivery)) = next else { break };
            seen.lock().unwrap().push(Seen {
                at: now_ms(),
                id: message_id(&delivery),
                due_at: header_i64(&delivery, "x-redisched-due-at"),
                redelivered: delivery.redelivered,
            });
            // A lost ack only means the broker redelivers (flagged `redelivered`).
            let _ = delivery.ack(BasicAckOptions::default()).await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "bye".into())).await;
    }
}

// ---------------------------------------------------------------------------------
// The verdict

#[derive(Debug)]
pub struct Report {
    pub accepted: usize,
    pub delivered: usize,
    pub lost: Vec<String>,
    /// Deliveries beyond the first of an id, not counting the broker's own
    /// redeliveries to the test consumer.
    pub duplicates: usize,
    pub early: Vec<String>,
    pub deleted_delivered: Vec<String>,
    pub unconfirmed: usize,
}

/// Checks the promise: every accepted job delivered, none early (neither before its
/// `x-redisched-due-at` nor before publish time + delay), no deleted one delivered.
pub fn verify(label: &str, ledger: &Ledger, seen: &[Seen]) -> Report {
    let mut first: HashMap<&str, usize> = HashMap::new();
    let mut duplicates = 0;
    let mut early = Vec::new();
    for s in seen {
        let count = first.entry(s.id.as_str()).or_insert(0);
        *count += 1;
        if *count > 1 && !s.redelivered {
            duplicates += 1;
        }
        if let Some(due) = s.due_at {
            if s.at < due {
                early.push(format!(
                    "{} arrived {} ms before its due time",
                    s.id,
                    due - s.at
                ));
            }
        }
        if let Some((sent, delay)) = ledger.accepted.get(&s.id) {
            if s.at + 5 < sent + delay {
                early.push(format!(
                    "{} arrived {} ms before publish + delay",
                    s.id,
                    sent + delay - s.at
                ));
            }
        }
    }
    let mut lost: Vec<String> = ledger
        .accepted
        .keys()
        .filter(|id| !first.contains_key(id.as_str()))
        .cloned()
        .collect();
    lost.sort();
    let deleted_delivered: Vec<String> = ledger
        .deleted
        .iter()
        .filter(|id| first.contains_key(id.as_str()))
        .cloned()
        .collect();
    let report = Report {
        accepted: ledger.accepted.len(),
        delivered: first.len(),
        lost,
        duplicates,
        early,
        deleted_delivered,
        unconfirmed: ledger.unconfirmed,
    };
    println!(
        "[{label}] accepted {} (+{} cancelled), delivered {} distinct, lost {}, duplicates {}, early {}, deleted-but-delivered {}, unconfirmed publishes {}",
        report.accepted,
        ledger.deleted.len(),
        report.delivered,
        report.lost.len(),
        report.duplicates,
        report.early.len(),
        report.deleted_delivered.len(),
        report.unconfirmed
    );
    report
}

/// Fails the test unless nothing was lost, early or resurrected, and duplicates stay
/// within `max_duplicates`.
pub fn assert_promise(report: &Report, max_duplicates: usize, context: &str) {
    assert!(
        report.accepted > 0,
        "the test accepted no job at all\n{context}"
    );
    assert!(
        report.lost.is_empty(),
        "lost {} accepted jobs, e.g. {:?}\n{context}",
        report.lost.len(),
        &report.lost[..report.lost.len().min(10)]
    );
    assert!(
        report.early.is_empty(),
        "early deliveries: {:?}",
        &report.early[..report.early.len().min(10)]
    );
    assert!(
        report.deleted_delivered.is_empty(),
        "deleted jobs delivered: {:?}",
        report.deleted_delivered
    );
    assert!(
        report.duplicates <= max_duplicates,
        "{} duplicates, more than the bound {max_duplicates}",
        report.duplicates
    );
}

// ---------------------------------------------------------------------------------
// Bridges as child processes

/// Env vars for the settings `env_for` leaves out and the fault tests tune.
pub fn extra_env(config: &Config) -> Vec<(String, String)> {
    [
        (
            "REDISCHED_AMQP__HEARTBEAT_SECS",
            config.amqp.heartbeat_secs.to_string(),
        ),
        (
            "REDISCHED_REDIS__RESPONSE_TIMEOUT_MS",
            config.redis.response_timeout_ms.to_string(),
        ),
        (
            "REDISCHED_REDIS__CONNECT_TIMEOUT_MS",
            config.redis.connect_timeout_ms.to_string(),
        ),
        (
            "REDISCHED_INGEST__PREFETCH",
            config.ingest.prefetch.to_string(),
        ),
        ("REDISCHED_INGEST__BATCH", config.ingest.batch.to_string()),
        (
            "REDISCHED_DISPATCH__WINDOW",
            config.dispatch.window.to_string(),
        ),
        (
            "REDISCHED_DISPATCH__BATCH",
            config.dispatch.batch.to_string(),
        ),
        (
            "REDISCHED_LOG__LEVEL",
            "redisched=info,lapin=error".to_string(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A `redisched run` child with every setting of `config`, logging to `log`.
pub fn spawn_bridge(config: &Config, log: &Path) -> ChildBridge {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("bridge log file");
    let err = out.try_clone().expect("bridge log file");
    let child = Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("run")
        .envs(env_for(config))
        .envs(extra_env(config))
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn redisched run");
    ChildBridge { child }
}

/// Number of messages ready in a queue (passive declare).
pub async fn queue_depth(channel: &Channel, queue: &str) -> Option<u32> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .ok()
        .map(|q| q.message_count())
}

/// Deletes the exchanges and queues of `config` on the broker at `url` (best effort).
pub async fn cleanup_amqp(url: &str, config: &Config) {
    let Ok(Ok(conn)) = tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    else {
        return;
    };
    if let Ok(channel) = conn.create_channel().await {
        let a = &config.amqp;
        for queue in [&a.commands_queue, &a.invalid_queue] {
            let _ = channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        for exchange in [&a.commands_exchange, &a.invalid_exchange, &a.ready_exchange] {
            let _ = channel
                .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
    }
    let _ = conn.close(200, "bye".into()).await;
}

/// Deletes the test's exchanges and queues (and the collector's queue) on the broker
/// at `url` when dropped, also after a failed assertion.
pub struct AmqpCleanup {
    pub url: String,
    pub config: Config,
}

impl Drop for AmqpCleanup {
    fn drop(&mut self) {
        let (url, config) = (self.url.clone(), self.config.clone());
        // Drop cannot await, and may run inside the test's runtime: use a thread with
        // a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                cleanup_amqp(&url, &config).await;
                let collector = format!("{}.collector", config.redis.prefix);
                if let Ok(Ok(conn)) = tokio::time::timeout(
                    Duration::from_secs(5),
                    Connection::connect(&url, ConnectionProperties::default()),
                )
                .await
                {
                    if let Ok(channel) = conn.create_channel().await {
                        let _ = channel
                            .queue_delete(collector.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                    let _ = conn.close(200, "bye".into()).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

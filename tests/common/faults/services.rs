//! The services a fault test owns: a private `redis-server` and a private RabbitMQ node
//! (killed, restarted, alarmed at will), plus temp dirs, free ports and log tails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::Rng;

use crate::common::bridge::now_ms;
use crate::common::unique;

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

/// A `redis-server` child on its own port with AOF `appendfsync always`: what it
/// acknowledged survives a SIGKILL. Killed on drop.
pub struct PrivateRedis {
    pub port: u16,
    dir: TempDir,
    child: Option<Child>,
    /// The address this server replicates from, if it is a replica.
    primary: Option<std::net::SocketAddr>,
}

impl PrivateRedis {
    pub fn start() -> Self {
        let mut redis = Self {
            port: free_port(),
            dir: TempDir::new("redis"),
            child: None,
            primary: None,
        };
        redis.spawn();
        redis
    }

    /// A replica of the server at `primary` (a [`PrivateRedis`]'s address, or a proxy in
    /// front of it, to stall or cut replication), started and in sync.
    pub fn start_replica_of(primary: std::net::SocketAddr) -> Self {
        let mut redis = Self {
            port: free_port(),
            dir: TempDir::new("replica"),
            child: None,
            primary: Some(primary),
        };
        redis.spawn();
        redis.wait_in_sync();
        redis
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// A plain connection to this server, for inspection.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .expect("connect to the private redis-server")
    }

    /// One field of `INFO <section>` (`master_link_status`, `cmdstat_wait`…), if present.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        let info: String = redis::cmd("INFO")
            .arg(section)
            .query(&mut self.connection())
            .expect("INFO");
        info.lines()
            .find_map(|line| line.strip_prefix(&format!("{field}:")))
            .map(|value| value.trim().to_string())
    }

    /// Waits until a replica's link to its primary is up and the first sync is done.
    pub fn wait_in_sync(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self
            .info_field("replication", "master_link_status")
            .as_deref()
            != Some("up")
        {
            assert!(
                Instant::now() < deadline,
                "replica not in sync within 20 s:\n{}",
                tail(&self.dir.path().join("redis.log"), 20)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `REPLICAOF NO ONE`: a replica becomes a primary (what a failover does).
    pub fn promote(&self) {
        let _: String = redis::cmd("REPLICAOF")
            .arg("NO")
            .arg("ONE")
            .query(&mut self.connection())
            .expect("REPLICAOF NO ONE");
    }

    /// SIGSTOP: the process stops reading and answering (a stalled replica), until
    /// [`PrivateRedis::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`PrivateRedis::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// The running server's process id (its main thread's too).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn spawn(&mut self) {
        let dir = self.dir.path();
        let mut command = redisched_testkit::redis_server(self.port, dir);
        if let Some(primary) = self.primary {
            command.args([
                "--replicaof",
                &primary.ip().to_string(),
                &primary.port().to_string(),
            ]);
        }
        let child = command
            .args(["--appendonly", "yes", "--appendfsync", "always"])
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
            // A stopped process dies of SIGKILL too; no SIGCONT needed.
            let _ = child.kill(); // SIGKILL on unix
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and directory (replaying the AOF).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Starts it again on the same port with its data gone: what clients see when a
    /// Redis without persistence restarts (no keys, no scripts).
    pub fn restart_empty(&mut self) {
        self.kill9();
        for entry in std::fs::read_dir(self.dir.path()).expect("redis dir") {
            let path = entry.expect("redis dir entry").path();
            if path.file_name().is_some_and(|name| name != "redis.log") {
                let gone = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                gone.expect("remove redis data");
            }
        }
        self.spawn();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill9();
    }
}

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

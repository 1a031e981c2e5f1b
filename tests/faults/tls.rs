//! TLS on both links: a private `redis-server` with only a TLS port and a private
//! RabbitMQ node with only an AMQPS listener, both with a throwaway CA and server
//! certificate made by `openssl` for this run. A bridge that trusts the CA (via
//! `redis.tls_ca_file` / `amqp.tls_ca_file`) delivers a job end to end; clients that do
//! not trust it (system roots only, or another CA) and plaintext clients are refused.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::types::AMQPValue;
use lapin::{Connection, ConnectionProperties};
use redisched::config::Config;
use redisched::store::Store;

use common::bridge::{message_id, now_ms, test_config, Broker, InProcess};
use common::faults::{
    bounded, free_port, init_logging, tail, PrivateRabbit, TempDir, FAULT_TEST_LIMIT,
};
use common::DEFAULT_LIMITS;

// ---------------------------------------------------------------------------------
// Throwaway certificates

/// A CA, a server certificate it signed for 127.0.0.1 and localhost, and a second,
/// unrelated CA (for "trusts the wrong CA"). Removed on drop.
struct Certs {
    dir: TempDir,
}

impl Certs {
    fn make() -> Self {
        let certs = Self {
            dir: TempDir::new("tls-certs"),
        };
        let dir = certs.dir.path();
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName = IP:127.0.0.1, DNS:localhost\n\
             basicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, digitalSignature, keyEncipherment\n\
             extendedKeyUsage = serverAuth\n",
        )
        .expect("write server.ext");
        for ca in ["ca", "other-ca"] {
            openssl(
                dir,
                &format!(
                    "req -x509 -newkey rsa:2048 -nodes -days 2 -keyout {ca}.key -out {ca}.pem \
                     -subj /CN=redisched-throwaway-{ca} \
                     -addext basicConstraints=critical,CA:TRUE \
                     -addext keyUsage=critical,keyCertSign,cRLSign"
                ),
            );
        }
        openssl(
            dir,
            "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
        );
        openssl(
            dir,
            "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
             -extfile server.ext -out server.pem",
        );
        // The server processes may run as another user; the key is throwaway anyway.
        for file in ["server.key", "server.pem", "ca.pem"] {
            let _ = Command::new("chmod")
                .arg("644")
                .arg(dir.join(file))
                .status();
        }
        certs
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn file(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

/// Runs `openssl` with whitespace-separated `args` in `dir`.
fn openssl(dir: &Path, args: &str) {
    let output = Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run openssl (is it installed?)");
    assert!(
        output.status.success(),
        "openssl {args} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

// ---------------------------------------------------------------------------------
// A private redis-server with a TLS port only

struct TlsRedis {
    port: u16,
    dir: TempDir,
    child: Child,
}

impl TlsRedis {
    fn start(certs: &Certs) -> Self {
        let port = free_port();
        let dir = TempDir::new("tls-redis");
        // No plain port: TLS only.
        let child = redisched_testkit::redis_server(0, dir.path())
            .args(["--tls-port", &port.to_string()])
            .args(["--tls-cert-file", &certs.file("server.pem")])
            .args(["--tls-key-file", &certs.file("server.key")])
            .args(["--tls-ca-cert-file", &certs.file("ca.pem")])
            .args(["--tls-auth-clients", "no"])
            .spawn()
            .expect("spawn redis-server (is it installed?)");
        let redis = Self { port, dir, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "private TLS redis-server did not listen (built without TLS?):\n{}",
                tail(&redis.dir.path().join("redis.log"), 20)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        redis
    }

    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// A private RabbitMQ node with an AMQPS listener only.

fn tls_rabbit(certs: &Certs) -> Result<PrivateRabbit, String> {
    PrivateRabbit::start_configured(None, |port| {
        format!(
            "listeners.tcp = none\n\
             listeners.ssl.1 = 127.0.0.1:{port}\n\
             ssl_options.cacertfile = {ca}\n\
             ssl_options.certfile = {cert}\n\
             ssl_options.keyfile = {key}\n\
             ssl_options.verify = verify_none\n\
             ssl_options.fail_if_no_peer_cert = false\n",
            ca = certs.file("ca.pem"),
            cert = certs.file("server.pem"),
            key = certs.file("server.key"),
        )
    })
}

fn amqps_url(rabbit: &PrivateRabbit) -> String {
    format!("amqps://guest:guest@127.0.0.1:{}/%2f", rabbit.port)
}

// ---------------------------------------------------------------------------------
// Helpers

/// A producer/consumer over AMQPS that trusts `ca`.
async fn tls_broker(config: &Config, ca: &Path) -> Broker {
    let tls = redisched::tls::amqp_tls_config(Some(ca)).expect("read CA");
    let runtime = lapin::runtime::default_runtime().expect("runtime");
    let connection = Connection::connect_with_config(
        &config.amqp.url,
        ConnectionProperties::default(),
        tls,
        runtime,
    )
    .await
    .unwrap_or_else(|e| panic!("test client cannot connect over AMQPS: {e}"));
    Broker::over(config, connection).await
}

/// Connecting to Redis as `config` says fails (within the timeout, not by hanging).
async fn redis_refused(config: &Config, what: &str) {
    let attempt = tokio::time::timeout(
        Duration::from_secs(15),
        Store::connect(&config.connect_options(), DEFAULT_LIMITS),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: the Redis connect hung"));
    match attempt {
        Ok(_) => panic!("{what}: connected to Redis, but must be refused"),
        Err(err) => eprintln!("{what}: refused as expected: {err}"),
    }
}

/// Connecting to RabbitMQ as `config` says fails (the bridge's own connect is checked
/// by running a whole bridge below).
async fn amqp_refused(config: &Config, what: &str) {
    let ca = redisched::tls::ca_file(&config.amqp.tls_ca_file);
    let tls = redisched::tls::amqp_tls_config(ca).expect("read CA");
    let runtime = lapin::runtime::default_runtime().expect("runtime");
    let attempt = tokio::time::timeout(
        Duration::from_secs(15),
        Connection::connect_with_config(
            &config.amqp.url,
            ConnectionProperties::default(),
            tls,
            runtime,
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: the AMQP connect hung"));
    match attempt {
        Ok(_) => panic!("{what}: connected to RabbitMQ, but must be refused"),
        Err(err) => eprintln!("{what}: refused as expected: {err}"),
    }
}

// ---------------------------------------------------------------------------------

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn jobs_flow_over_tls_on_both_links_and_untrusted_or_plaintext_clients_are_refused() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let certs = Certs::make();
        let redis = TlsRedis::start(&certs);
        let rabbit = match tls_rabbit(&certs) {
            Ok(rabbit) => rabbit,
            Err(err) => panic!("cannot start a private RabbitMQ node with TLS: {err}"),
        };

        let mut config = test_config("tls");
        config.redis.url = redis.url();
        config.redis.tls_ca_file = certs.file("ca.pem");
        config.amqp.url = amqps_url(&rabbit);
        config.amqp.tls_ca_file = certs.file("ca.pem");
        config.validate().expect("TLS config is valid");

        // 1. End to end over both TLS links: put -> stored in Redis -> due -> delivered.
        let broker = tls_broker(&config, &certs.path("ca.pem")).await;
        let mut ready = broker.consume_ready("#").await;
        let bridge = InProcess::start(&config);
        let sent = now_ms();
        broker
            .put(
                "tls.check",
                "job-1",
                b"over TLS",
                &[("x-delay", AMQPValue::LongInt(500))],
            )
            .await;
        let (at, job) = ready
            .next(Duration::from_secs(30))
            .await
            .expect("the job is delivered over TLS");
        assert_eq!(message_id(&job), "job-1");
        assert_eq!(job.data, b"over TLS");
        assert!(at >= sent + 500, "delivered early: {} ms", at - sent);
        let mut options = config.connect_options();
        options.tls_ca_file = Some(certs.path("ca.pem"));
        let store = Store::connect(&options, DEFAULT_LIMITS)
            .await
            .expect("a store over TLS");
        let topic = redisched::job::Topic::new("tls.check").expect("topic");
        let stats = store.stats(&topic).await.expect("stats over TLS");
        eprintln!("stats over TLS after delivery: {stats:?}");
        bridge.stop().await;

        // 2. Clients that do not trust the CA are refused, with a clear error, and there is
        //    no fallback to plaintext (the servers have no plaintext port to fall back to,
        //    and a plaintext client to the TLS port fails).
        let mut untrusted = config.clone();
        untrusted.redis.tls_ca_file = String::new();
        untrusted.amqp.tls_ca_file = String::new();
        untrusted
            .validate()
            .expect("TLS without a CA file is valid (system roots)");
        redis_refused(&untrusted, "Redis, system roots only").await;
        amqp_refused(&untrusted, "AMQP, system roots only").await;

        let mut wrong_ca = config.clone();
        wrong_ca.redis.tls_ca_file = certs.file("other-ca.pem");
        wrong_ca.amqp.tls_ca_file = certs.file("other-ca.pem");
        redis_refused(&wrong_ca, "Redis, another CA").await;
        amqp_refused(&wrong_ca, "AMQP, another CA").await;

        let mut plaintext = config.clone();
        plaintext.redis.url = format!("redis://127.0.0.1:{}/0", redis.port);
        plaintext.redis.tls_ca_file = String::new();
        plaintext.amqp.url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.port);
        plaintext.amqp.tls_ca_file = String::new();
        redis_refused(&plaintext, "Redis, plaintext to the TLS port").await;
        amqp_refused(&plaintext, "AMQP, plaintext to the TLS port").await;

        // 3. A whole bridge that trusts Redis's CA but not the broker's: it keeps retrying
        //    the broker and never takes a command; it still stops cleanly.
        let mut half = config.clone();
        half.amqp.tls_ca_file = String::new();
        let blind = InProcess::start(&half);
        broker
            .put(
                "tls.check",
                "job-2",
                b"never",
                &[("x-delay", AMQPValue::LongInt(0))],
            )
            .await;
        assert!(
            ready.next(Duration::from_secs(4)).await.is_none(),
            "a bridge that does not trust the broker's CA delivered a job"
        );
        assert!(
            !blind.handle.is_finished(),
            "the bridge gave up instead of retrying"
        );
        blind.stop().await;

        // The trusted bridge picks the waiting command up: nothing was lost meanwhile.
        let bridge = InProcess::start(&config);
        let (_, job) = ready
            .next(Duration::from_secs(30))
            .await
            .expect("the waiting job is delivered once a trusting bridge runs");
        assert_eq!(message_id(&job), "job-2");
        bridge.stop().await;
        broker.cleanup().await;
    });
}

//! HTTP and logging hardening: security headers on every response, slow clients timed
//! out, a cap on open connections that event streams count against but are not cut by,
//! and no job body in the logs whatever `RUST_LOG` says.

use crate::common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::bridge::{test_config, text, Broker};
use redisched::config::Config;
use redisched::feed::{Event, Feed};
use redisched::http::{self, AppState};
use redisched::job::{JobId, Topic};
use redisched::metrics::Metrics;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const SECOND: Duration = Duration::from_secs(1);

/// The HTTP server on a free port, stopped on drop.
struct Site {
    base: String,
    addr: std::net::SocketAddr,
    feed: Feed,
    shutdown: CancellationToken,
    _store: common::TestStore,
}

impl Site {
    async fn start(config: Config) -> Self {
        let store = common::test_store().await;
        let feed = Feed::new();
        let state = AppState {
            store: store.store.clone(),
            metrics: Arc::new(Metrics::new()),
            feed: feed.clone(),
            config: Arc::new(config),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        tokio::spawn(http::serve(state, listener, shutdown.clone()));
        Self {
            base: format!("http://{addr}"),
            addr,
            feed,
            shutdown,
            _store: store,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(10 * SECOND)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_carries_the_security_headers() {
    let mut config = Config::default();
    config.http.token = "write-token".into();
    let site = Site::start(config).await;
    let client = client();
    // The page, open ops routes, a refused API call, a 404, the contract, a bad method.
    for (method, path, status) in [
        ("GET", "/", 200),
        ("GET", "/healthz", 200),
        ("GET", "/metrics", 200),
        ("GET", "/v1/openapi.json", 200),
        ("GET", "/v1/topics", 401),
        ("GET", "/no/such/route", 404),
        ("DELETE", "/healthz", 405),
    ] {
        let res = client
            .request(method.parse().unwrap(), site.url(path))
            .bearer_auth(if status == 401 {
                "wrong"
            } else {
                "write-token"
            })
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), status, "{method} {path}");
        let h = res.headers();
        let get = |name: &str| {
            h.get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_else(|| panic!("{method} {path}: no {name} header"))
                .to_string()
        };
        assert_eq!(get("x-frame-options"), "DENY", "{method} {path}");
        assert_eq!(get("x-content-type-options"), "nosniff", "{method} {path}");
        assert_eq!(get("referrer-policy"), "no-referrer", "{method} {path}");
        let csp = get("content-security-policy");
        for directive in [
            "default-src 'none'",
            "frame-ancestors 'none'",
            "connect-src 'self'",
        ] {
            assert!(csp.contains(directive), "{method} {path}: {csp}");
        }
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert!(csp.contains("script-src 'sha256-"), "{csp}");
    }
}

/// Sends `head` one byte per second on a fresh connection until the server closes it;
/// how long that took, or `None` if still open after `patience`.
async fn slow_loris(addr: std::net::SocketAddr, patience: Duration) -> Option<Duration> {
    let started = Instant::now();
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let trickle = async move {
        for byte in head.iter().cycle() {
            if write.write_all(&[*byte]).await.is_err() {
                break;
            }
            tokio::time::sleep(SECOND).await;
        }
    };
    let closed = async move {
        let mut buf = [0u8; 512];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    };
    tokio::select! {
        _ = closed => Some(started.elapsed()),
        _ = trickle => Some(started.elapsed()),
        _ = tokio::time::sleep(patience) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_connections_are_closed_after_the_header_read_timeout() {
    let mut config = Config::default();
    config.http.header_read_timeout_ms = 2_000;
    let site = Site::start(config).await;
    let lorises: Vec<_> = (0..50)
        .map(|_| tokio::spawn(slow_loris(site.addr, 12 * SECOND)))
        .collect();
    let mut closed_after = Vec::new();
    for loris in lorises {
        closed_after.push(loris.await.unwrap());
    }
    let slowest = closed_after.iter().max().copied().flatten();
    assert!(
        closed_after.iter().all(Option::is_some),
        "{} of 50 slow clients still open after 12 s",
        closed_after.iter().filter(|c| c.is_none()).count()
    );
    let slowest = slowest.unwrap();
    println!("50 slow clients closed, the last after {slowest:?} (timeout 2 s)");
    // 2 s timeout; the rest is scheduling slack on a loaded machine.
    assert!(
        slowest < 4 * SECOND,
        "last slow client closed after {slowest:?}"
    );
    // A well-behaved client is still served.
    let res = client().get(site.url("/healthz")).send().await.unwrap();
    assert_eq!(res.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let mut config = Config::default();
    config.http.max_connections = 3;
    config.http.header_read_timeout_ms = 60_000;
    let site = Site::start(config).await;
    // Three silent connections take every slot.
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(site.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fourth = {
        let url = site.url("/healthz");
        tokio::spawn(async move { client().get(url).send().await.map(|r| r.status()) })
    };
    tokio::time::sleep(2 * SECOND).await;
    assert!(
        !fourth.is_finished(),
        "a fourth connection was served while three held the cap of 3"
    );
    // One closes: the waiting connection is accepted and served.
    drop(idle.pop());
    let served = tokio::time::timeout(5 * SECOND, fourth).await;
    let status = served
        .expect("served within 5 s once below the cap")
        .unwrap()
        .expect("an answer");
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_count_against_the_cap_and_outlive_the_header_timeout() {
    const STREAMS: usize = 200;
    let mut config = Config::default();
    config.http.header_read_timeout_ms = 500;
    // Every stream holds a connection: 200 streams and one more request fit exactly.
    config.http.max_connections = STREAMS + 1;
    let site = Site::start(config).await;
    let client = client();
    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        let res = client
            .get(site.url("/v1/events"))
            .timeout(60 * SECOND)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        streams.push(res);
    }
    // Several header timeouts pass; the streams stay open.
    tokio::time::sleep(2 * SECOND).await;
    site.feed.send(Event::Dispatched {
        topic: "t".into(),
        id: "after-the-timeout".into(),
        due_at: 1,
        attempt: 1,
        at: 2,
        lateness_ms: 1,
    });
    for (i, res) in streams.iter_mut().enumerate() {
        let mut got = String::new();
        let deadline = Instant::now() + 10 * SECOND;
        while !got.contains("after-the-timeout") {
            let chunk = tokio::time::timeout_at(deadline.into(), res.chunk()).await;
            match chunk {
                Ok(Ok(Some(bytes))) => got.push_str(&String::from_utf8_lossy(&bytes)),
                other => panic!("stream {i} ended or stalled: {other:?}; got {got:?}"),
            }
        }
    }
    // The 201st connection is served beside them.
    let res = reqwest::Client::new()
        .get(site.url("/healthz"))
        .timeout(5 * SECOND)
        .send()
        .await
        .expect("a request beside 200 event streams");
    assert_eq!(res.status(), 200);
}

/// The marker as it appears in a log line: as text, or as the `Debug` list of its bytes
/// (how lapin prints a message body).
fn marker_forms(marker: &str) -> [String; 2] {
    let bytes: Vec<String> = marker.bytes().map(|b| b.to_string()).collect();
    [marker.to_string(), bytes.join(", ")]
}

/// Runs the bridge with `RUST_LOG=<rust_log>`: one job dispatched to a routing key no
/// queue is bound to (returned, retried), one delivered, one invalid command; then
/// checks that no body or header value of them reached stdout or stderr.
async fn no_body_in_logs_with(rust_log: &str) {
    let mut config = test_config("nobodylog");
    config.http.enabled = false;
    let marker = common::unique("BODYMARK");
    let broker = Broker::new(&config).await;
    let mut delivered = broker.consume_ready("routed").await;
    let out = std::env::temp_dir().join(format!("{}.out", config.redis.prefix));
    let err = std::env::temp_dir().join(format!("{}.err", config.redis.prefix));
    let child = Command::new(env!("CARGO_BIN_EXE_redisched"))
        .arg("run")
        .envs(config.to_env())
        .env("RUST_LOG", rust_log)
        .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err).unwrap()))
        .spawn()
        .expect("spawn redisched run");
    let mut bridge = redisched_testkit::ChildBridge { child };

    let body = format!("secret body {marker}");
    let header = [("x-app-note", text(&format!("note {marker}")))];
    broker
        .put("unrouted", "returned-1", body.as_bytes(), &header)
        .await;
    broker
        .put("routed", "delivered-1", body.as_bytes(), &header)
        .await;
    // No message_id: set aside as invalid.
    broker
        .command("routed", lapin::BasicProperties::default(), body.as_bytes())
        .await;
    let got = delivered.collect(1, 30 * SECOND).await;
    assert_eq!(got.len(), 1, "the routed job was delivered");
    // The unroutable one is returned and retried (200 ms, then doubling).
    let store = common::test_store_named(&config.redis.prefix).await;
    let (topic, id) = (
        Topic::new("unrouted").unwrap(),
        JobId::new("returned-1").unwrap(),
    );
    let deadline = Instant::now() + 30 * SECOND;
    loop {
        let job = store.get(&topic, &id).await.unwrap();
        let failures = job.as_ref().map_or(0, |j| j.failures);
        if failures >= 2 {
            let reason = job.and_then(|j| j.last_error).map(|e| e.reason);
            assert!(
                reason.as_deref().is_some_and(|r| r.contains("unroutable")),
                "{reason:?}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "the job was never returned");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, _) = bridge
        .terminate(60 * SECOND)
        .expect("signal")
        .expect("stopped");
    let logs = [
        std::fs::read_to_string(&out).unwrap_or_default(),
        std::fs::read_to_string(&err).unwrap_or_default(),
    ]
    .join("\n");
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&err);
    broker.cleanup().await;
    common::delete_prefix(&config.redis.prefix);
    assert!(status.success(), "{status:?}");
    // The run did log, and saw the return: otherwise the test proves nothing.
    assert!(
        logs.lines().count() > 3,
        "RUST_LOG={rust_log}: hardly any log:\n{logs}"
    );
    for form in marker_forms(&marker) {
        if let Some(line) = logs.lines().find(|l| l.contains(&form)) {
            panic!("RUST_LOG={rust_log}: a job body or header reached the log:\n{line}");
        }
    }
    println!(
        "RUST_LOG={rust_log}: {} log lines, no body",
        logs.lines().count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_job_body_reaches_the_log_at_info() {
    no_body_in_logs_with("info").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_job_body_reaches_the_log_at_trace() {
    no_body_in_logs_with("trace").await;
}

//! The web dashboard in a real headless browser (Debian's chromium + chromedriver, see
//! scripts/browser-deps.sh): schedule a job in the page and see it listed, see a
//! dispatched job arrive in the live feed, cancel another job and see it gone. Leaves a
//! screenshot at artifacts/dashboard.png.

mod common;

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use redisched::config::Config;
use redisched::feed::{Event, Feed};
use redisched::http::{self, AppState};
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::metrics::Metrics;
use redisched::store::PutRequest;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(15);

/// chromedriver on a free loopback port, killed on drop, with a fresh profile dir.
struct Driver {
    child: Child,
    url: String,
    profile: PathBuf,
}

impl Driver {
    fn start() -> Self {
        for tool in ["chromium", "chromedriver"] {
            let found = Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                found,
                "{tool} is not installed: run `bash scripts/browser-deps.sh` (Debian packages chromium, chromium-driver)"
            );
        }
        let port = StdListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = std::env::temp_dir().join(common::unique("chromium-profile"));
        std::fs::create_dir_all(&profile).expect("profile dir");
        let driver = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            profile,
        };
        let deadline = Instant::now() + WAIT;
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        driver
    }

    async fn browser(&self) -> Client {
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1440,900",
            &format!("--user-data-dir={}", self.profile.display()),
        ];
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({ "binary": "/usr/bin/chromium", "args": args }),
        );
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("a chromium session")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

async fn wait_for(client: &Client, css: &str) {
    client
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css} did not appear: {e}"));
}

async fn wait_gone(client: &Client, css: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let found = client.find_all(Locator::Css(css)).await.expect("find_all");
        if found.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{css} is still there");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn fill(client: &Client, css: &str, text: &str) {
    let field = client.find(Locator::Css(css)).await.expect(css);
    field.clear().await.expect("clear");
    field.send_keys(text).await.expect("type");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_schedules_lists_streams_and_cancels() {
    let store = common::test_store().await;
    let topic = Topic::new("emails").unwrap();
    for (id, delay_ms, body) in [
        ("to-cancel", 3_600_000, "bye"),
        ("reminder-7", 7_200_000, "{\"user\":7}"),
        ("digest-weekly", 5 * 86_400_000, "weekly"),
    ] {
        store
            .put(PutRequest {
                topic: topic.clone(),
                id: JobId::new(id).unwrap(),
                body: body.as_bytes().to_vec(),
                meta: Vec::new(),
                due: Due::Delay(delay_ms),
                mode: PutMode::Keep,
            })
            .await
            .unwrap();
    }

    let state = AppState {
        store: store.store.clone(),
        metrics: Arc::new(Metrics::new()),
        feed: Feed::new(),
        config: Arc::new(Config::default()),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(http::serve(state.clone(), listener, shutdown.clone()));

    let driver = Driver::start();
    let client = driver.browser().await;
    client
        .goto(&format!("{base}/"))
        .await
        .expect("open the dashboard");
    wait_for(&client, "#live.on").await; // the event stream is connected
    wait_for(&client, "#topics tr[data-topic='emails']").await;
    wait_for(&client, "#jobs tr[data-id='to-cancel']").await;

    // Schedule a job through the form.
    fill(&client, "#s-topic", "emails").await;
    fill(&client, "#s-id", "welcome-42").await;
    fill(&client, "#s-body", "{\"to\":\"ann@example.com\"}").await;
    fill(&client, "#s-delay", "10m").await;
    client
        .find(Locator::Css("#s-submit"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(&client, "#jobs tr[data-id='welcome-42']").await;
    let job = store
        .get(&topic, &JobId::new("welcome-42").unwrap())
        .await
        .unwrap()
        .expect("scheduled through the page");
    assert_eq!(job.body, b"{\"to\":\"ann@example.com\"}");
    let now = store.server_time().await.unwrap();
    assert!(
        (now + 590_000..=now + 600_000).contains(&job.due_at),
        "due in 10 minutes"
    );
    wait_for(
        &client,
        "#feed li[data-kind='command'][data-id='welcome-42']",
    )
    .await;

    // A dispatched job shows up in the live feed.
    state.feed.send(Event::Dispatched {
        topic: "emails".into(),
        id: "reminder-7".into(),
        due_at: now,
        attempt: 1,
        at: now + 4,
        lateness_ms: 4,
    });
    wait_for(
        &client,
        "#feed li[data-kind='dispatched'][data-id='reminder-7']",
    )
    .await;
    let text = client
        .find(Locator::Css("#feed li[data-kind='dispatched']"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("emails/reminder-7 delivered"), "{text}");

    // Cancel another job with the cancel form; it leaves the list and the store.
    fill(&client, "#c-topic", "emails").await;
    fill(&client, "#c-id", "to-cancel").await;
    client
        .find(Locator::Css("#c-submit"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_gone(&client, "#jobs tr[data-id='to-cancel']").await;
    assert!(store
        .get(&topic, &JobId::new("to-cancel").unwrap())
        .await
        .unwrap()
        .is_none());
    let status = client
        .find(Locator::Css("#status"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(status, "cancelled emails/to-cancel");
    wait_for(
        &client,
        "#feed li[data-kind='command'][data-id='to-cancel']",
    )
    .await;

    // Counts in the topics table follow: 3 scheduled now (2 left + the new one).
    let deadline = Instant::now() + WAIT;
    loop {
        let row = client
            .find(Locator::Css("#topics tr[data-topic='emails']"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if row.split_whitespace().nth(1) == Some("3") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "topic row shows 3 scheduled: {row:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let png = client.screenshot().await.expect("screenshot");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    std::fs::write(dir.join("dashboard.png"), png).expect("write the screenshot");

    client.close().await.expect("close the browser");
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
}

//! The web dashboard in a real headless browser (Debian's chromium + chromedriver, see
//! scripts/browser-deps.sh): schedule a job in the page and see it listed, see a
//! dispatched job arrive in the live feed, cancel another job and see it gone; the
//! activity charts after a burst of commands and dispatches, the due histogram of a topic;
//! pause and resume, parked and failing jobs with re-drive, the history panel; the page
//! with a configured token and a read token; the page under its Content-Security-Policy
//! (no violation) and refused inside a frame of another origin; the layout at 1,400 px
//! (long ids wrap, the topics table does not scroll). Leaves screenshots at artifacts/dashboard*.png
//! and in the temp dir (the path is printed).
//!
//! The browser tests take turns (one chromium at a time: the machine has two cores).

use crate::common;

use std::net::TcpListener as StdListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use redisched::config::Config;
use redisched::feed::{Event, Feed};
use redisched::http::{self, AppState};
use redisched::job::spec::ScheduleSpec;
use redisched::job::{Due, JobId, PutMode, Topic};
use redisched::metrics::Metrics;
use redisched::store::{HealthOp, JobState, Lease, PutRequest, RetryOutcome, Store};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// Generous: the machine is shared and often loaded; a pass takes far less.
const WAIT: Duration = Duration::from_secs(30);

/// One browser at a time.
static BROWSER_TURN: LazyLock<tokio::sync::Mutex<()>> =
    LazyLock::new(|| tokio::sync::Mutex::new(()));

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
        // A process group of its own: the chromium it starts joins it, so a test that
        // panics before closing its session still leaves no browser behind (see Drop).
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
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
        // The whole group: chromedriver and the browser it started.
        let _ = Command::new("kill")
            .args(["-TERM", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// What the page says (status line, live badge, topics shown), for failure messages.
async fn page_state(client: &Client) -> String {
    let script = "return ['status: ' + document.getElementById('status').textContent, \
                  'live: ' + document.getElementById('live').textContent, \
                  'topics: ' + [...document.querySelectorAll('#topics tr')].map(r => r.dataset.topic).join(' ')];";
    match client.execute(script, Vec::new()).await {
        Ok(value) => value.to_string(),
        Err(e) => format!("(page state unreadable: {e})"),
    }
}

async fn wait_for(client: &Client, css: &str) {
    if let Err(e) = client
        .wait()
        .at_most(WAIT)
        .for_element(Locator::Css(css))
        .await
    {
        panic!(
            "{css} did not appear: {e}; page: {}",
            page_state(client).await
        );
    }
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

/// Fills the schedule form (topic, id, then `fields` by selector), submits it, and
/// waits until the job's row shows.
async fn schedule_through_form(client: &Client, topic: &str, id: &str, fields: &[(&str, &str)]) {
    fill(client, "#s-topic", topic).await;
    fill(client, "#s-id", id).await;
    for (css, text) in fields {
        fill(client, css, text).await;
    }
    client
        .find(Locator::Css("#s-submit"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(client, &format!("#jobs tr[data-id='{id}']")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_schedules_lists_streams_and_cancels() {
    let _turn = BROWSER_TURN.lock().await;
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
    let fields = [
        ("#s-body", "{\"to\":\"ann@example.com\"}"),
        ("#s-delay", "10m"),
    ];
    schedule_through_form(&client, "emails", "welcome-42", &fields).await;
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

    // A series with jitter and expiry through the same form.
    let fields = [
        ("#s-every", "1h"),
        ("#s-jitter", "10m"),
        ("#s-expires", "30m"),
    ];
    schedule_through_form(&client, "emails", "digest", &fields).await;
    let series = store
        .get(&topic, &JobId::new("digest").unwrap())
        .await
        .unwrap()
        .expect("a series scheduled through the page");
    assert!(series.spec.is_some(), "recurring: {series:?}");
    let meta = redisched::job::meta::decode_meta(&series.meta).expect("meta");
    assert_eq!(redisched::job::meta::jitter_of(&meta), 600_000);
    assert_eq!(
        redisched::job::expiry::of_job(&meta).expect("expiry header"),
        Some(1_800_000)
    );

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

    // Counts in the topics table follow: 4 scheduled now (2 left + the two new ones).
    let deadline = Instant::now() + WAIT;
    loop {
        let row = client
            .find(Locator::Css("#topics tr[data-topic='emails']"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if row.split_whitespace().nth(1) == Some("4") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "topic row shows 4 scheduled: {row:?}"
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

// ------------------------------------------------------------------ shared by the tests below

/// The HTTP server on a free port over `store`, stopped on drop.
struct Site {
    base: String,
    state: AppState,
    shutdown: CancellationToken,
}

impl Site {
    async fn start(store: &Store, config: Config) -> Self {
        let state = AppState {
            store: store.clone(),
            metrics: Arc::new(Metrics::new()),
            feed: Feed::new(),
            config: Arc::new(config),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        tokio::spawn(http::serve(state.clone(), listener, shutdown.clone()));
        Self {
            base,
            state,
            shutdown,
        }
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        self.shutdown.cancel();
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

/// Puts `id` due now, reserves it and records a failed publish: with `max_attempts` 1
/// it is parked, with 0 it is due again after `retry_in` with its `last_error`.
async fn fail(
    store: &Store,
    topic: &Topic,
    id: &str,
    reason: &str,
    max_attempts: u32,
    retry_in: Duration,
) {
    put(store, topic, id, Due::NOW).await;
    let batch = store
        .reserve(topic, Duration::from_secs(30), 10)
        .await
        .unwrap();
    let job = batch
        .jobs
        .iter()
        .find(|j| j.id == id)
        .unwrap_or_else(|| panic!("{id} reserved: {:?}", batch.jobs));
    let lease = Lease {
        topic: topic.clone(),
        id: id.to_string(),
        token: job.token,
    };
    let outcome = store
        .retry_failed(&lease, retry_in, reason, max_attempts)
        .await
        .unwrap();
    let expected = if max_attempts == 1 {
        RetryOutcome::Parked
    } else {
        RetryOutcome::Retried
    };
    assert_eq!(outcome, expected, "{id}");
}

/// Clicks `css` once it is there; the page re-renders its tables every few seconds, so
/// an element replaced between finding and clicking it is found again.
async fn click(client: &Client, css: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let result = match client.find(Locator::Css(css)).await {
            Ok(element) => element.click().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => {
                panic!("click {css}: {e}; page: {}", page_state(client).await)
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The rendered text of `css` (found again if the page replaced it meanwhile).
async fn text_of(client: &Client, css: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let result = match client.find(Locator::Css(css)).await {
            Ok(element) => element.text().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(text) => return text,
            Err(e) if Instant::now() > deadline => panic!("text of {css}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Runs `script` (a function body returning a JSON-able value) in the page.
async fn js(client: &Client, script: &str) -> Value {
    client
        .execute(script, Vec::new())
        .await
        .unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
}

/// Polls `check` until it returns `Some`, or fails with the last `None` reason.
async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(why) if Instant::now() > deadline => panic!("{what}: {why}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(150)).await,
        }
    }
}

/// A screenshot of the page in a 1440x1700 window, to the temp dir and to artifacts/
/// (path printed).
async fn screenshot(client: &Client, name: &str) -> PathBuf {
    client.set_window_size(1440, 1700).await.expect("resize");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let png = client.screenshot().await.expect("screenshot");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    std::fs::write(dir.join(format!("{name}.png")), &png).expect("write the screenshot");
    let file = std::env::temp_dir().join(format!("{}-{name}.png", common::unique("shot")));
    std::fs::write(&file, &png).expect("write the screenshot");
    println!("screenshot: {}", file.display());
    client
        .set_window_size(1440, 900)
        .await
        .expect("resize back");
    file
}

/// `{from, to, count}` of every bar of the due histogram, in order.
async fn bars(client: &Client) -> Vec<(i64, i64, u64)> {
    let value = js(
        client,
        "return [...document.querySelectorAll('#due-chart rect.bar')].map(r => \
         [Number(r.dataset.from), Number(r.dataset.to), Number(r.dataset.count)]);",
    )
    .await;
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b[0].as_i64().unwrap(),
                b[1].as_i64().unwrap(),
                b[2].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Waits for `n` bars, then checks each counts exactly the `due` times in its `(from, to]`;
/// returns how many jobs the bars hold.
async fn check_bars(client: &Client, n: usize, due: &[i64]) -> u64 {
    let shown = eventually(&format!("{n} bars"), || async {
        let shown = bars(client).await;
        if shown.len() == n {
            Ok(shown)
        } else {
            Err(format!("{} bars", shown.len()))
        }
    })
    .await;
    let mut total = 0;
    for (from, to, count) in &shown {
        let expected = due.iter().filter(|&&d| *from < d && d <= *to).count() as u64;
        assert_eq!(*count, expected, "bar ({from}, {to}] of {shown:?}");
        total += count;
    }
    total
}

/// `(points, sum)` of one series path of a line chart.
async fn series(client: &Client, chart: &str, name: &str) -> (u64, f64) {
    let value = js(
        client,
        &format!(
            "const p = document.querySelector('#{chart} path.series[data-series=\"{name}\"]'); \
             return p ? [Number(p.dataset.points), Number(p.dataset.sum), p.getAttribute('d')] : null;"
        ),
    )
    .await;
    let points = value[0].as_u64().unwrap_or(0);
    let sum = value[1].as_f64().unwrap_or(0.0);
    if points > 0 {
        assert!(value[2].as_str().unwrap().len() > 5, "{value}");
    }
    (points, sum)
}

/// Every piece of visible text whose contrast with what is behind it is below 4.5:1
/// (WCAG AA), as `"<text>: <ratio>"`. Backgrounds are found by walking up to the first
/// opaque one; SVG text is measured by its fill against the chart's white.
const CONTRAST_CHECK: &str = r#"
  const rgb = (c) => { const m = c.match(/[\d.]+/g); return m ? m.map(Number) : [0, 0, 0, 0]; };
  const lum = ([r, g, b]) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = (el) => {
    for (let n = el; n && n.nodeType === 1; n = n.parentElement) {
      const style = getComputedStyle(n);
      const c = rgb(style.backgroundColor);
      if (style.backgroundColor !== "transparent" && (c.length < 4 || c[3] > 0.5)) return c;
      if (style.backgroundImage.includes("gradient")) {
        const g = style.backgroundImage.match(/rgba?\([^)]*\)/);
        if (g) return rgb(g[0]);
      }
    }
    return [255, 255, 255];
  };
  const bad = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let t = walker.nextNode(); t; t = walker.nextNode()) {
    const text = t.textContent.trim();
    const el = t.parentElement;
    if (!text || !el || el.closest("script, style, title, [hidden], .sr-only, details:not([open]) > table")) continue;
    const rect = el.getBoundingClientRect();
    if (rect.width === 0 || rect.height === 0) continue;
    const style = getComputedStyle(el);
    const svgText = el instanceof SVGElement;
    const fg = rgb(svgText ? style.fill : style.color);
    const bg = svgText ? [255, 255, 255] : background(el);
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
    const ratio = (a + 0.05) / (b + 0.05);
    if (ratio < 4.5) bad.push(text.slice(0, 40) + ": " + ratio.toFixed(2));
  }
  return bad;
"#;

/// Tabs through the page from the top, returning a label of each focused control and
/// whether it showed a focus outline.
async fn tab_through(client: &Client, presses: usize) -> Vec<(String, bool)> {
    js(client, "document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0); return null;").await;
    let mut seen = Vec::new();
    for _ in 0..presses {
        // The page re-renders its tables while it is tabbed through: a focused row
        // control replaced in between is stale, and the Tab goes to the new one.
        let mut tries = 0;
        while let Err(err) = client
            .active_element()
            .await
            .expect("the focused element")
            .send_keys("\u{E004}")
            .await
        {
            tries += 1;
            assert!(tries < 5, "Tab: {err:?}");
        }
        let focused = js(
            client,
            "const a = document.activeElement; const s = getComputedStyle(a); \
             if (a === document.body) return ['(page)', true]; \
             return [a.id || a.getAttribute('aria-label') || a.textContent.trim().slice(0, 40), \
                     s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) >= 2];",
        )
        .await;
        seen.push((
            focused[0].as_str().unwrap_or("").to_string(),
            focused[1].as_bool().unwrap_or(false),
        ));
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charts_render_a_burst_and_the_due_histogram() {
    let _turn = BROWSER_TURN.lock().await;
    let store = common::test_store().await;
    let topic = Topic::new("charts").unwrap();
    let mut hour = Vec::new();
    for (id, delay) in [
        ("soon-1", 3 * 60_000),
        ("soon-2", 3 * 60_000 + 5_000),
        ("mid", 20 * 60_000),
        ("late", 50 * 60_000),
    ] {
        hour.push(put(&store, &topic, id, Due::Delay(delay)).await);
    }
    let evening = put(&store, &topic, "evening", Due::Delay(5 * 3_600_000)).await;
    put(&store, &topic, "next-week", Due::Delay(7 * 86_400_000)).await;

    let site = Site::start(&store, Config::default()).await;
    let driver = Driver::start();
    let client = driver.browser().await;
    client.goto(&format!("{}/", site.base)).await.unwrap();
    wait_for(&client, "#live.on").await;
    click(&client, "#topics tr[data-topic='charts'] button").await;

    // The next hour: 60 one-minute bars, each with exactly the jobs due in it.
    assert_eq!(check_bars(&client, 60, &hour).await, 4);
    let summary = text_of(&client, "#due-summary").await;
    assert!(
        summary.starts_with("4 jobs due in the next hour in charts, 2 later"),
        "{summary}"
    );
    let label = js(
        &client,
        "return document.querySelector('#due-chart title').textContent;",
    )
    .await;
    assert_eq!(
        label.as_str(),
        Some(summary.as_str()),
        "the chart's text equivalent"
    );
    // The next day: 48 half-hour bars; the evening job joins, next week's stays later.
    click(&client, "#range-day").await;
    let mut day = hour.clone();
    day.push(evening);
    assert_eq!(check_bars(&client, 48, &day).await, 5);
    assert_eq!(
        text_of(&client, "#range-day").await,
        "Next day",
        "the pressed range button"
    );
    let pressed = js(
        &client,
        "return document.querySelector('#range-day').getAttribute('aria-pressed');",
    )
    .await;
    assert_eq!(pressed, "true");

    // A burst: 20 puts through the REST API (command events from the real handler) and
    // 30 dispatches with lateness 1..=30 ms.
    let http = reqwest::Client::new();
    for i in 0..20 {
        let response = http
            .put(format!(
                "{}/v1/topics/burst/jobs/b-{i}?delay_ms=7200000",
                site.base
            ))
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 201);
    }
    let now = store.server_time().await.unwrap();
    for i in 1..=30 {
        site.state.feed.send(Event::Dispatched {
            topic: "charts".into(),
            id: format!("d-{i}"),
            due_at: now - i,
            attempt: 1,
            at: now,
            lateness_ms: i,
        });
    }
    // Rates are per 5 s bin: the sum of a series' points times 5 is its event count.
    let (points, sum) = eventually("30 dispatches charted", || async {
        let (points, sum) = series(&client, "rate-chart", "dispatched").await;
        if (sum * 5.0 - 30.0).abs() < 0.01 {
            Ok((points, sum))
        } else {
            Err(format!("dispatched sum {sum}"))
        }
    })
    .await;
    assert_eq!(points, 60, "one point per 5 s over 5 minutes ({sum})");
    eventually("20 commands charted", || async {
        let (_, sum) = series(&client, "rate-chart", "commands").await;
        if (sum * 5.0 - 20.0).abs() < 0.01 {
            Ok(())
        } else {
            Err(format!("commands sum {sum}"))
        }
    })
    .await;
    let (p50_points, _) = series(&client, "late-chart", "p50").await;
    let (p99_points, p99_sum) = series(&client, "late-chart", "p99").await;
    assert!(
        (1..=2).contains(&p50_points),
        "lateness only where dispatches were: {p50_points}"
    );
    assert!((1..=2).contains(&p99_points) && p99_sum > 0.0);
    eventually("lateness summary", || async {
        let text = text_of(&client, "#late-summary").await;
        if text.contains("Last 5 minutes: p50 15 ms, p99 30 ms, max 30 ms over 30 dispatches.") {
            Ok(())
        } else {
            Err(text)
        }
    })
    .await;
    // Read together: the page redraws both every second, and its "now" rates move.
    let both = js(
        &client,
        "return [document.querySelector('#rate-summary').textContent, \
         document.querySelector('#rate-chart title').textContent];",
    )
    .await;
    let rates = both[0].as_str().unwrap_or_default().to_string();
    assert!(
        rates.contains("30 in 5 min") && rates.contains("20 in 5 min"),
        "{rates}"
    );
    assert_eq!(both[1].as_str(), Some(rates.as_str()), "the chart's title");

    screenshot(&client, "dashboard-charts").await;
    client.close().await.expect("close the browser");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_parked_failing_redrive_and_history() {
    let _turn = BROWSER_TURN.lock().await;
    let store = common::test_store().await;
    let topic = Topic::new("ops").unwrap();
    put(&store, &topic, "waiting", Due::Delay(600_000)).await;
    // A live rate limit shows in the topics table (high enough to change nothing here).
    store
        .set_rate_limit(
            &topic,
            redisched::policy::RateLimit::new(1000.0, Some(100.0)).unwrap(),
        )
        .await
        .unwrap();
    store
        .put_recurring(
            PutRequest {
                topic: topic.clone(),
                id: JobId::new("digest").unwrap(),
                body: b"digest".to_vec(),
                meta: Vec::new(),
                due: Due::Delay(1_200_000),
                mode: PutMode::Keep,
            },
            ScheduleSpec::every(900_000),
        )
        .await
        .unwrap();
    fail(
        &store,
        &topic,
        "stuck-1",
        "unroutable: NO_ROUTE",
        1,
        Duration::ZERO,
    )
    .await;
    fail(&store, &topic, "stuck-2", "nack", 1, Duration::ZERO).await;
    fail(
        &store,
        &topic,
        "flaky",
        "channel error: 504",
        0,
        Duration::from_secs(3600),
    )
    .await;

    let site = Site::start(&store, Config::default()).await;
    let driver = Driver::start();
    let client = driver.browser().await;
    client.goto(&format!("{}/", site.base)).await.unwrap();
    wait_for(&client, "#live.on").await;
    click(&client, "#topics tr[data-topic='ops'] button").await;

    // Parked and failing jobs stand out, with their error text.
    wait_for(
        &client,
        "#parked tr[data-id='stuck-1'][data-state='parked']",
    )
    .await;
    let row = text_of(&client, "#parked tr[data-id='stuck-1']").await;
    assert!(
        row.contains("unroutable: NO_ROUTE") && row.contains("PARKED"),
        "{row}"
    );
    wait_for(&client, "#jobs tr.failing[data-id='flaky']").await;
    let series = text_of(&client, "#jobs tr[data-id='digest'] .badge.series").await;
    assert_eq!(series, "every 15m", "a recurring job shows its schedule");
    let row = text_of(&client, "#jobs tr[data-id='flaky']").await;
    assert!(row.contains("failing: channel error: 504"), "{row}");
    assert!(client
        .find_all(Locator::Css("#jobs tr.failing[data-id='waiting']"))
        .await
        .unwrap()
        .is_empty());
    let counts = text_of(&client, "#topics tr[data-topic='ops']").await;
    assert_eq!(
        counts.split_whitespace().collect::<Vec<_>>(),
        ["ops", "3", "0", "0", "2", "3", "0", "1000/s,", "burst", "100", "RUNNING"],
        "scheduled (waiting, digest, flaky), due, reserved, parked, failing, throttled, rate limit, state"
    );
    wait_for(&client, "#topics tr[data-topic='ops'] td.warn").await;
    wait_for(&client, "#topics tr[data-topic='ops'] td.bad").await;
    wait_for(
        &client,
        "#history li[data-outcome='parked'][data-id='stuck-2']",
    )
    .await;

    // Accessible: enough contrast everywhere (badges, error texts, axes), and every
    // control reachable by keyboard with a visible focus outline.
    let low = js(&client, CONTRAST_CHECK).await;
    assert_eq!(low, json!([]), "text below 4.5:1 contrast");
    let order = tab_through(&client, 44).await;
    let labels: Vec<&str> = order.iter().map(|(label, _)| label.as_str()).collect();
    for wanted in [
        "token",
        "Show topic ops",
        "pause",
        "range-day",
        "Re-drive job stuck-1",
        "Cancel job flaky",
    ] {
        assert!(
            labels.contains(&wanted),
            "{wanted} not reached by Tab: {labels:?}"
        );
    }
    let unmarked: Vec<&str> = order
        .iter()
        .filter(|(_, outline)| !outline)
        .map(|(label, _)| label.as_str())
        .collect();
    assert!(
        unmarked.is_empty(),
        "focus without a visible outline: {unmarked:?}"
    );

    // Pause: the state flips in Redis, the page says so.
    click(&client, "#pause").await;
    eventually("paused in Redis", || async {
        match store.is_paused(&topic).await.unwrap() {
            true => Ok(()),
            false => Err("not paused".to_string()),
        }
    })
    .await;
    wait_for(&client, "#topics tr[data-topic='ops'][data-paused='true']").await;
    wait_for(&client, "#topic-state.paused").await;
    let low = js(&client, CONTRAST_CHECK).await;
    assert_eq!(low, json!([]), "text below 4.5:1 contrast while paused");
    let status = text_of(&client, "#status").await;
    assert!(status.starts_with("paused ops"), "{status}");
    screenshot(&client, "dashboard-paused").await;

    // Resume.
    click(&client, "#resume").await;
    eventually("resumed in Redis", || async {
        match store.is_paused(&topic).await.unwrap() {
            false => Ok(()),
            true => Err("still paused".to_string()),
        }
    })
    .await;
    wait_gone(&client, "#topics tr[data-topic='ops'][data-paused='true']").await;
    wait_for(&client, "#pause:not([hidden])").await;

    // Re-drive one parked job, then the rest of the topic.
    click(&client, "#parked tr[data-id='stuck-1'] button.redrive").await;
    wait_gone(&client, "#parked tr[data-id='stuck-1']").await;
    let job = store
        .get(&topic, &JobId::new("stuck-1").unwrap())
        .await
        .unwrap()
        .expect("kept");
    assert_ne!(job.state, JobState::Parked);
    wait_for(
        &client,
        "#history li[data-outcome='re-driven'][data-id='stuck-1']",
    )
    .await;
    let redrive_all = text_of(&client, "#redrive-all").await;
    assert_eq!(redrive_all, "Re-drive all parked (1)");
    click(&client, "#redrive-all").await;
    wait_gone(&client, "#parked tr").await;
    assert_eq!(store.stats(&topic).await.unwrap().parked, 0);
    wait_for(&client, "#redrive-all[hidden]").await;
    wait_for(
        &client,
        "#history li[data-outcome='re-driven'][data-id='stuck-2']",
    )
    .await;

    client.close().await.expect("close the browser");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_configured_the_page_needs_one_and_a_read_token_only_reads() {
    let _turn = BROWSER_TURN.lock().await;
    let store = common::test_store().await;
    let topic = Topic::new("guarded").unwrap();
    put(&store, &topic, "secret-job", Due::Delay(900_000)).await;
    let mut config = Config::default();
    config.http.token = "write-token".into();
    config.http.read_token = "read-token".into();
    let site = Site::start(&store, config).await;
    let driver = Driver::start();
    let client = driver.browser().await;
    client.goto(&format!("{}/", site.base)).await.unwrap();

    // Without a token: nothing shown, the page says why.
    wait_for(&client, "#live.denied").await;
    eventually("a status asking for a token", || async {
        let status = text_of(&client, "#status").await;
        if status.contains("shows job data: send Authorization: Bearer") {
            Ok(())
        } else {
            Err(status)
        }
    })
    .await;
    assert!(client
        .find_all(Locator::Css("#topics tr"))
        .await
        .unwrap()
        .is_empty());

    // The read token: data and the live feed, but no changes.
    fill(&client, "#token", "read-token").await;
    click(&client, "h1").await;
    wait_for(&client, "#live.on").await;
    wait_for(&client, "#jobs tr[data-id='secret-job']").await;
    wait_for(&client, "#due-chart rect.bar[data-count='1']").await;
    click(&client, "#pause").await;
    eventually("a refusal", || async {
        let status = text_of(&client, "#status").await;
        if status.contains("this token may only read") {
            Ok(())
        } else {
            Err(status)
        }
    })
    .await;
    assert!(!store.is_paused(&topic).await.unwrap());
    wait_for(&client, "#status.error").await;
    screenshot(&client, "dashboard-read-token").await;

    // The full token: the same button pauses.
    fill(&client, "#token", "write-token").await;
    click(&client, "h1").await;
    click(&client, "#pause").await;
    eventually("paused with the full token", || async {
        match store.is_paused(&topic).await.unwrap() {
            true => Ok(()),
            false => Err(text_of(&client, "#status").await),
        }
    })
    .await;
    wait_for(&client, "#live.on").await;

    client.close().await.expect("close the browser");
}

/// A page on another origin (its own port) that frames `target`.
async fn framing_page(target: &str) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let html = format!(
        "<!doctype html><title>framer</title><iframe id=\"f\" src=\"{target}\" width=\"1200\" height=\"800\"></iframe>"
    );
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let html = html.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{html}",
                    html.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    (url, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_works_under_its_content_security_policy_and_cannot_be_framed() {
    let _turn = BROWSER_TURN.lock().await;
    let store = common::test_store().await;
    let topic = Topic::new("csp").unwrap();
    put(&store, &topic, "queued-1", Due::Delay(600_000)).await;
    let site = Site::start(&store, Config::default()).await;
    let driver = Driver::start();
    let client = driver.browser().await;
    client.goto(&format!("{}/", site.base)).await.unwrap();

    // The inline script ran (rows rendered), its fetch and EventSource reached the
    // server (connect-src), and the inline style applied (the header's colour).
    wait_for(&client, "#live.on").await;
    wait_for(&client, "#topics tr[data-topic='csp']").await;
    wait_for(&client, "#jobs tr[data-id='queued-1']").await;
    let header_bg = js(
        &client,
        "return getComputedStyle(document.querySelector('header')).backgroundColor;",
    )
    .await;
    assert_eq!(
        header_bg,
        json!("rgb(29, 35, 48)"),
        "the inline style applied"
    );
    // Whatever the page does from now on breaks no directive.
    js(
        &client,
        "window.cspViolations = []; \
         document.addEventListener('securitypolicyviolation', \
           (e) => window.cspViolations.push(e.violatedDirective + ' ' + e.blockedURI)); \
         return null;",
    )
    .await;
    fill(&client, "#s-topic", "csp").await;
    fill(&client, "#s-id", "from-the-page").await;
    fill(&client, "#s-delay", "5m").await;
    click(&client, "#s-submit").await;
    wait_for(&client, "#jobs tr[data-id='from-the-page']").await;
    site.state.feed.send(Event::Dispatched {
        topic: "csp".into(),
        id: "queued-1".into(),
        due_at: 1,
        attempt: 1,
        at: 2,
        lateness_ms: 1,
    });
    wait_for(
        &client,
        "#feed li[data-kind='dispatched'][data-id='queued-1']",
    )
    .await;
    wait_for(&client, "#due-chart rect.bar").await;
    let violations = js(&client, "return window.cspViolations;").await;
    assert_eq!(violations, json!([]), "CSP violations in the page");

    // Framed by a page of another origin (another port of this host): the browser
    // refuses to render the dashboard inside it.
    let (framer, server) = framing_page(&format!("{}/", site.base)).await;
    client.goto(&framer).await.unwrap();
    wait_for(&client, "#f").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    client.enter_frame(0).await.expect("enter the frame");
    let inside = client
        .execute(
            "return [location.href, !!document.getElementById('live')];",
            Vec::new(),
        )
        .await;
    match inside {
        Ok(value) => assert_eq!(
            value[1],
            json!(false),
            "the dashboard rendered inside a frame of another origin: {value}"
        ),
        // A blocked frame holds the browser's error page; scripts may not even run there.
        Err(e) => println!("frame not scriptable (blocked): {e}"),
    }
    client.enter_parent_frame().await.unwrap();
    server.abort();
    client.close().await.expect("close the browser");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_1400_px_long_ids_wrap_and_the_topics_table_needs_no_scrolling() {
    let _turn = BROWSER_TURN.lock().await;
    let store = common::test_store().await;
    let long_id = "reminder-for-user-0123456789abcdef0123456789abcdef-weekly-digest-europe-west";
    for name in ["emails-transactional", "billing", "reports-monthly"] {
        let topic = Topic::new(name).unwrap();
        put(&store, &topic, long_id, Due::Delay(600_000)).await;
    }
    let site = Site::start(&store, Config::default()).await;
    let driver = Driver::start();
    let client = driver.browser().await;
    client.set_window_size(1400, 1000).await.expect("resize");
    client.goto(&format!("{}/", site.base)).await.unwrap();
    wait_for(&client, "#live.on").await;
    wait_for(&client, "#topics tr[data-topic='reports-monthly']").await;
    site.state.feed.send(Event::Dispatched {
        topic: "emails-transactional".into(),
        id: long_id.into(),
        due_at: 1,
        attempt: 1,
        at: 2,
        lateness_ms: 1,
    });
    let item = format!("#feed li[data-kind='dispatched'][data-id='{long_id}']");
    wait_for(&client, &item).await;
    let width = js(&client, "return document.documentElement.clientWidth;").await;
    assert!(
        width.as_i64().is_some_and(|w| (1_300..=1_400).contains(&w)),
        "viewport {width}"
    );
    let file = screenshot_at(&client, "dashboard-1400", 1400).await;
    println!("1,400 px screenshot: {}", file.display());

    let topics = js(
        &client,
        "const box = document.getElementById('topics').closest('.scroll-x'); \
         return [box.scrollWidth, box.clientWidth];",
    )
    .await;
    assert!(
        topics[0].as_i64() <= topics[1].as_i64(),
        "the topics table scrolls horizontally at 1,400 px: [scrollWidth, clientWidth] = {topics}"
    );
    // The whole id is on screen (wrapped) and in the tooltip; nothing overflows the feed.
    let feed = js(
        &client,
        &format!(
            "const li = document.querySelector(\"{item}\"); const feed = document.getElementById('feed'); \
             const text = li.children[1]; \
             return [feed.scrollWidth, feed.clientWidth, text.scrollWidth, text.clientWidth, text.textContent, li.title];"
        ),
    )
    .await;
    assert!(
        feed[0].as_i64() <= feed[1].as_i64() && feed[2].as_i64() <= feed[3].as_i64(),
        "the feed overflows: {feed}"
    );
    assert!(
        feed[4].as_str().is_some_and(|t| t.contains(long_id)),
        "{feed}"
    );
    assert!(
        feed[5].as_str().is_some_and(|t| t.contains(long_id)),
        "the full value in the tooltip: {feed}"
    );
    client.close().await.expect("close the browser");
}

/// A screenshot in a `width` x 1300 window (temp dir and artifacts/), path returned.
async fn screenshot_at(client: &Client, name: &str, width: u32) -> PathBuf {
    client.set_window_size(width, 1300).await.expect("resize");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let png = client.screenshot().await.expect("screenshot");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    std::fs::write(dir.join(format!("{name}.png")), &png).expect("write the screenshot");
    let file = std::env::temp_dir().join(format!("{}-{name}.png", common::unique("shot")));
    std::fs::write(&file, &png).expect("write the screenshot");
    file
}

/// Webhook targets on the page: the panel lists them, a failing one stands out (row and
/// last status marked, the error in the tooltip), a healthy one does not, and a topic
/// names the target its jobs go to; a topic whose target's breaker holds it carries a
/// badge (target and state, the reason on hover), one whose target is closed none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_targets_show_and_a_failing_one_stands_out() {
    let _turn = BROWSER_TURN.lock().await;
    let store = common::test_store().await;
    for topic in ["billing.eu", "mail.news"] {
        put(
            &store,
            &Topic::new(topic).unwrap(),
            "job-1",
            Due::Delay(600_000),
        )
        .await;
    }
    let mut config = Config::default();
    for (name, pattern) in [("billing", "billing.#"), ("mailer", "mail.#")] {
        config.targets.push(redisched::targets::TargetConfig {
            name: name.into(),
            topics: vec![pattern.into()],
            url: "http://127.0.0.1:9/receive".into(),
            ..Default::default()
        });
    }
    let mailer = &config.targets[1];
    store
        .target_health(&mailer.name, &mailer.breaker, HealthOp::Disable)
        .await
        .expect("disable mailer");
    let site = Site::start(&store, config).await;
    let webhooks = &site.state.metrics.webhooks;
    webhooks.started("billing");
    webhooks.finished("billing", "2xx", "200".into(), None, 0.01);
    let error = "HTTP 503 Service Unavailable from mailer: down for maintenance";
    webhooks.started("mailer");
    webhooks.finished("mailer", "5xx", "503".into(), Some(error.into()), 0.02);

    let driver = Driver::start();
    let client = driver.browser().await;
    client.goto(&format!("{}/", site.base)).await.unwrap();
    wait_for(&client, "#targets tr.failing").await;
    let rows = js(
        &client,
        "return [...document.querySelectorAll('#targets tr')].map(r => \
           [r.children[0].textContent, r.classList.contains('failing'), \
            r.querySelector('td.last-status').classList.contains('bad'), \
            r.querySelector('td.last-status').title, \
            r.querySelector('td.last-status').textContent, r.lastElementChild.textContent]);",
    )
    .await;
    assert_eq!(
        rows,
        json!([
            ["billing", false, false, "", "200", "closed"],
            [
                "mailer",
                true,
                true,
                error,
                "503",
                "disabled (held by the breaker)"
            ]
        ]),
        "{rows}"
    );
    assert!(!js(
        &client,
        "return document.getElementById('targets-section').hidden;"
    )
    .await
    .as_bool()
    .unwrap_or(true));
    wait_for(&client, "#topics tr[data-topic='billing.eu']").await;
    let topic_row = text_of(&client, "#topics tr[data-topic='billing.eu']").await;
    assert!(topic_row.contains("→ billing"), "{topic_row}");
    wait_for(&client, "#topics tr[data-topic='mail.news'] .badge.held").await;
    let badges = js(
        &client,
        "return [...document.querySelectorAll('#topics tr')].map(r => \
           [r.dataset.topic, r.dataset.heldBy || null, \
            [...r.querySelectorAll('.badge.held')].map(b => [b.textContent, b.title])]);",
    )
    .await;
    assert_eq!(
        badges,
        json!([
            ["billing.eu", null, []],
            ["mail.news", "mailer", [[
                "held by mailer (disabled)",
                "Held by the breaker of target mailer (disabled): disabled by hand. Its jobs wait, spending no attempts."
            ]]]
        ]),
        "{badges}"
    );
    screenshot(&client, "dashboard-targets").await;
    client.close().await.expect("close the browser");
}

//! A real HTTP server standing in for a webhook consumer: it records every request
//! (headers, body, when) and answers with scripted statuses, headers and delays.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// One scripted answer.
#[derive(Clone, Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// Waits this long before answering (a slow or hanging receiver).
    pub delay: Duration,
}

impl Answer {
    pub fn status(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: String::new(),
            delay: Duration::ZERO,
        }
    }
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
    pub fn body(mut self, body: &str) -> Self {
        self.body = body.into();
        self
    }
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// A request as received.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub at: Instant,
    pub epoch_ms: i64,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }
}

#[derive(Default)]
struct Shared {
    script: Mutex<VecDeque<Answer>>,
    default: Mutex<Option<Answer>>,
    /// Answers by path prefix, before the script (a flaky path beside a healthy one).
    routes: Mutex<Vec<(String, Answer)>>,
    received: Mutex<Vec<Recorded>>,
    arrived: Notify,
}

pub struct Receiver {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl Receiver {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// On a given address (to come back up on the port a bridge already targets).
    pub async fn start_on(addr: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind the receiver");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        let stop = CancellationToken::new();
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let token = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { token.cancelled().await })
                .await;
        });
        Self { addr, shared, stop }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Answers to give, in order, before the default (200).
    pub fn script(&self, answers: impl IntoIterator<Item = Answer>) {
        self.shared.script.lock().unwrap().extend(answers);
    }

    /// The answer to every request whose path starts with `prefix`, before the script.
    pub fn answer_path(&self, prefix: &str, answer: Answer) {
        self.shared
            .routes
            .lock()
            .unwrap()
            .push((prefix.into(), answer));
    }

    /// The answer once the script is used up.
    pub fn set_default(&self, answer: Answer) {
        *self.shared.default.lock().unwrap() = Some(answer);
    }

    pub fn received(&self) -> Vec<Recorded> {
        self.shared.received.lock().unwrap().clone()
    }

    /// Waits until `count` requests arrived (or `timeout`); returns all so far.
    pub async fn wait_for(&self, count: usize, timeout: Duration) -> Vec<Recorded> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.shared.arrived.notified();
            let got = self.received();
            if got.len() >= count || Instant::now() >= deadline {
                return got;
            }
            let _ = tokio::time::timeout_at(deadline.into(), notified).await;
        }
    }

    /// Stops listening (open connections are dropped with the server task).
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let epoch_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let routed = shared
        .routes
        .lock()
        .unwrap()
        .iter()
        .find(|(prefix, _)| uri.path().starts_with(prefix.as_str()))
        .map(|(_, answer)| answer.clone());
    let answer = routed
        .or_else(|| shared.script.lock().unwrap().pop_front())
        .or_else(|| shared.default.lock().unwrap().clone())
        .unwrap_or_else(|| Answer::status(200));
    shared.received.lock().unwrap().push(Recorded {
        at: Instant::now(),
        epoch_ms,
        path: uri.path().to_owned(),
        headers,
        body: body.to_vec(),
    });
    shared.arrived.notify_waiters();
    if !answer.delay.is_zero() {
        tokio::time::sleep(answer.delay).await;
    }
    let mut response = (StatusCode::from_u16(answer.status).unwrap(), answer.body).into_response();
    for (name, value) in answer.headers {
        response.headers_mut().insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(&value).unwrap(),
        );
    }
    response
}

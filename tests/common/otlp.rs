//! A real OTLP/HTTP trace receiver for the tests: `otlp_receiver.py` beside this file,
//! which decodes the bridge's exports with PyPI `opentelemetry-proto` and prints each
//! span as a JSON line; this side starts it, collects the spans and waits for them.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const HOW_TO_INSTALL: &str =
    "the OTLP receiver needs python3 with opentelemetry-proto: run `bash scripts/otel-deps.sh`";

/// A running receiver; stopped on drop.
pub struct OtlpReceiver {
    child: Child,
    port: u16,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl OtlpReceiver {
    /// Starts the receiver on a free loopback port (panics with how to install it).
    pub fn start() -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/otlp_receiver.py");
        let mut child = Command::new("python3")
            .args(["-u", script])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("python3: {e}; {HOW_TO_INSTALL}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut reader = BufReader::new(stdout);
        let mut first = String::new();
        reader.read_line(&mut first).ok();
        let Some(port) = first
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
        else {
            child.kill().ok();
            child.wait().ok();
            panic!("the OTLP receiver did not start (said {first:?}); {HOW_TO_INSTALL}");
        };
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in reader.lines() {
                let Ok(line) = line else { break };
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| serde_json::json!({ "error": "not JSON", "line": line }));
                sink.lock().unwrap().push(value);
            }
        });
        Self { child, port, lines }
    }

    /// The base URL to configure as `telemetry.otlp_endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Value> {
        let lines = self.lines.lock().unwrap();
        if let Some(error) = lines.iter().find(|l| l.get("error").is_some()) {
            panic!("the OTLP receiver refused an export: {error}");
        }
        lines.clone()
    }

    /// Waits until some received span satisfies `matches`; all received spans then.
    /// Panics after `timeout` with what did arrive.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        matches: impl Fn(&Value) -> bool,
    ) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if spans.iter().any(&matches) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "no matching span within {timeout:?}; received: {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A span's attribute as text, number or bool (JSON), `Null` when absent.
pub fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    &span["attributes"][key]
}

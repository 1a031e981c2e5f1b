//! Webhook signature verifiers we did not write, run on a request the bridge sent: the
//! PyPI `standardwebhooks` and `svix` libraries (`tests/verifiers/verify.py`) and the npm
//! `standardwebhooks` library (`tests/verifiers/verify.mjs`). `bash
//! scripts/webhook-deps.sh` installs them.

use std::io::Write as _;
use std::process::{Command, Stdio};

use base64::Engine as _;

use super::receiver::Recorded;

/// A library that verifies Standard Webhooks signatures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verifier {
    PythonStandardWebhooks,
    PythonSvix,
    NodeStandardWebhooks,
}

pub const ALL: [Verifier; 3] = [
    Verifier::PythonStandardWebhooks,
    Verifier::PythonSvix,
    Verifier::NodeStandardWebhooks,
];

const HOW_TO_INSTALL: &str = "install the verifiers with: bash scripts/webhook-deps.sh";

impl Verifier {
    pub fn name(self) -> &'static str {
        match self {
            Self::PythonStandardWebhooks => "standardwebhooks (PyPI)",
            Self::PythonSvix => "svix (PyPI)",
            Self::NodeStandardWebhooks => "standardwebhooks (npm)",
        }
    }

    /// Verifies `request` with `secret`: `Err` with the library's words. Panics (with how
    /// to install it) when the library is not there, so a missing install never reads
    /// as a refused signature.
    pub fn verify(self, request: &Recorded, secret: &str) -> Result<(), String> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/verifiers");
        let mut command = match self {
            Self::NodeStandardWebhooks => {
                assert!(
                    std::path::Path::new(dir)
                        .join("node_modules/standardwebhooks")
                        .is_dir(),
                    "npm standardwebhooks is not installed; {HOW_TO_INSTALL}"
                );
                let mut c = Command::new("node");
                c.arg(format!("{dir}/verify.mjs"));
                c
            }
            _ => {
                let mut c = Command::new("python3");
                c.arg(format!("{dir}/verify.py"));
                c
            }
        };
        let headers: serde_json::Map<String, serde_json::Value> =
            ["webhook-id", "webhook-timestamp", "webhook-signature"]
                .iter()
                .map(|h| (h.to_string(), request.header(h).unwrap_or_default().into()))
                .collect();
        let input = serde_json::json!({
            "library": if self == Self::PythonSvix { "svix" } else { "standardwebhooks" },
            "secret": secret,
            "body": base64::engine::general_purpose::STANDARD.encode(&request.body),
            "headers": headers,
        });
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}; {HOW_TO_INSTALL}", self.name()));
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.to_string().as_bytes())
            .expect("write the request");
        let out = child.wait_with_output().expect("the verifier's output");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !said.contains("ModuleNotFoundError") && !said.contains("ERR_MODULE_NOT_FOUND"),
            "{} is not installed: {said}; {HOW_TO_INSTALL}",
            self.name()
        );
        if out.status.success() && said.contains("verified") {
            Ok(())
        } else {
            Err(said)
        }
    }
}

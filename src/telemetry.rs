//! Logging set-up: tracing with key/value fields, human or JSON lines on stderr.
//!
//! The filter comes from `log.level` in the config; a non-empty `RUST_LOG` overrides it
//! (handy for a one-off `RUST_LOG=redisched=debug redisched run`).
//!
//! Whatever that filter says, [`payload_cap`] applies on top: the AMQP and Redis client
//! libraries log messages and frames, bodies included (lapin warns with the whole message
//! on every unroutable publish, and traces every frame), so their targets are capped
//! below the levels that carry payloads. Job bodies never reach the log.

use std::io::IsTerminal;

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

use crate::config::LogConfig;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("config key `log.level`: {0}")]
    Level(String),
    #[error("RUST_LOG: {0}")]
    RustLog(String),
    #[error("config key `log.format`: `{0}` is neither `human` nor `json`")]
    Format(String),
    #[error("a logger is already installed: {0}")]
    AlreadySet(String),
}

/// The filter to use: `RUST_LOG` when set and non-empty, else `log.level`.
pub fn filter(log: &LogConfig) -> Result<EnvFilter, TelemetryError> {
    match std::env::var(EnvFilter::DEFAULT_ENV) {
        Ok(from_env) if !from_env.trim().is_empty() => {
            EnvFilter::try_new(&from_env).map_err(|e| TelemetryError::RustLog(e.to_string()))
        }
        _ => EnvFilter::try_new(&log.level).map_err(|e| TelemetryError::Level(e.to_string())),
    }
}

/// The ceiling for library targets that can log message contents, stacked after the
/// user's filter: an event passes only if both let it.
pub fn payload_cap() -> Targets {
    Targets::new()
        .with_default(LevelFilter::TRACE)
        // Frames (with body frames) at trace, deliveries at debug; info and above log
        // connection and channel state only.
        .with_target("lapin", LevelFilter::INFO)
        // A warning per returned message, printed whole; dispatch reports returns itself.
        .with_target("lapin::returned_messages", LevelFilter::OFF)
        .with_target("amq_protocol", LevelFilter::INFO)
        .with_target("amq_protocol_tcp", LevelFilter::INFO)
        .with_target("amq_protocol_types", LevelFilter::INFO)
        .with_target("amq_protocol_uri", LevelFilter::INFO)
        .with_target("tcp_stream", LevelFilter::INFO)
        // Connection state at trace; commands (script arguments are job bodies) never
        // logged, but debug is as far as anyone needs the client.
        .with_target("redis", LevelFilter::DEBUG)
}

/// Installs the global subscriber. Call once, early in `main`.
pub fn init(log: &LogConfig) -> Result<(), TelemetryError> {
    let filter = filter(log)?;
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(payload_cap());
    let result = match log.format.as_str() {
        "human" => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_writer(std::io::stderr),
            )
            .try_init(),
        "json" => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
        other => return Err(TelemetryError::Format(other.to_string())),
    };
    result.map_err(|e| TelemetryError::AlreadySet(e.to_string()))
}

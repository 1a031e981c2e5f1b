//! Logging set-up: tracing with key/value fields, human or JSON lines on stderr; and,
//! when `[telemetry]` names an OTLP endpoint, OpenTelemetry traces (`export.rs`: the
//! exporter; `spans.rs`: the spans the stages make and the trace context they pass on).
//!
//! Off (the default), no OpenTelemetry layer is installed and the span helpers hand out
//! `Span::none()`: the logging set-up and every stage's cost are what they were.
//!
//! The filter comes from `log.level` in the config; a non-empty `RUST_LOG` overrides it
//! (handy for a one-off `RUST_LOG=redisched=debug redisched run`).
//!
//! Whatever that filter says, [`payload_cap`] applies on top: the AMQP and Redis client
//! libraries log messages and frames, bodies included (lapin warns with the whole message
//! on every unroutable publish, and traces every frame), so their targets are capped
//! below the levels that carry payloads. Job bodies never reach the log.

use std::io::IsTerminal;

use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::{Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, TelemetryConfig};

mod export;
mod spans;

pub use export::{
    traces_endpoint, Endpoint, Telemetry, OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SDK_DISABLED,
};
pub use spans::{
    delivery_span, enabled, http_command_span, ingest_span, inject_amqp, inject_http, outgoing,
    record_http_status, record_outcome, Delivery, HttpCommand, Ingest, Via, TARGET,
};

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
    #[error("{key}: {message}")]
    Export { key: String, message: String },
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

/// Installs the global subscriber. Call once, early in `main` (inside the runtime: the
/// exporter sends from it). With an OTLP endpoint ([`traces_endpoint`]) the spans of
/// `spans.rs` are exported too; the returned [`Telemetry`] flushes them at shutdown.
pub fn init(log: &LogConfig, telemetry: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    let filter = filter(log)?;
    let env = |name: &str| std::env::var(name).ok();
    let Some(endpoint) = traces_endpoint(&telemetry.otlp_endpoint, env)? else {
        init_logging(log, filter)?;
        return Ok(Telemetry::off());
    };
    let exporting = export::Exporting::start(telemetry, &endpoint, env)?;
    let tracer = exporting.tracer();
    // Per-layer filters: the user's filter and the cap apply to the log alone (it never
    // shows our spans, so its lines are what they were), the OpenTelemetry layer sees only
    // the spans of `spans.rs`, whatever the log level.
    let log_filter = filter.and(payload_cap().with_target(TARGET, LevelFilter::OFF));
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target(TARGET, LevelFilter::TRACE));
    let registry = tracing_subscriber::registry().with(otel);
    let result = match log.format.as_str() {
        "human" => registry.with(human().with_filter(log_filter)).try_init(),
        "json" => registry.with(json().with_filter(log_filter)).try_init(),
        other => return Err(TelemetryError::Format(other.to_string())),
    };
    result.map_err(|e| TelemetryError::AlreadySet(e.to_string()))?;
    spans::enable();
    tracing::info!(
        endpoint = %crate::urls::redact_url(&endpoint.url),
        from = endpoint.source,
        sampling_ratio = telemetry.sampling_ratio,
        service_name = %telemetry.service_name,
        "exporting traces over OTLP/HTTP"
    );
    Ok(Telemetry::on(exporting))
}

/// Logging alone, as before OpenTelemetry: global filters, nothing else installed.
fn init_logging(log: &LogConfig, filter: EnvFilter) -> Result<(), TelemetryError> {
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(payload_cap());
    let result = match log.format.as_str() {
        "human" => registry.with(human()).try_init(),
        "json" => registry.with(json()).try_init(),
        other => return Err(TelemetryError::Format(other.to_string())),
    };
    result.map_err(|e| TelemetryError::AlreadySet(e.to_string()))
}

/// Log lines for people (colour on a terminal).
fn human<S>() -> impl Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
}

/// One JSON object per line, fields flattened.
fn json<S>() -> impl Layer<S> + Send + Sync
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_writer(std::io::stderr)
}

//! redisched: schedule jobs for later delivery, cancel or replace them by the id the
//! producer chose.
//!
//! The path of one job: [`ingest`] decodes an AMQP command and applies it through
//! [`store`] (Lua scripts in Redis); [`dispatch`] reserves it when due, hands it to the
//! sink its topic routes to (published with publisher confirms, or POSTed to a webhook
//! target) and releases it once the sink delivered it; [`requeue`] makes reservations of
//! crashed bridges due again. A job's vocabulary is [`job`]'s. See ARCHITECTURE.md.
#![forbid(unsafe_code)]
// The product's functions stay under clippy.toml's threshold (80 lines), or say why not;
// tests and bench scenarios are stories read top to bottom and are not held to it. A
// result the product discards says so (`.ok()` and why), never a silent `let _ =`.
#![warn(clippy::too_many_lines, clippy::let_underscore_must_use)]

pub mod amqp;
pub mod app;
pub mod cli;
pub mod config;
pub mod dispatch;
pub mod events;
pub mod feed;
pub mod http;
pub mod ingest;
pub mod job;
pub mod log_throttle;
pub mod metrics;
pub mod policy;
pub mod requeue;
pub mod shutdown;
pub mod store;
pub mod targets;
pub mod telemetry;
pub mod tls;
pub mod urls;
pub mod view;

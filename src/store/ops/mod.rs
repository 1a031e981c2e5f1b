//! One file per store operation, as each script has one Lua file: its request and reply
//! types (those shared by several operations stay in `types.rs`), building its calls,
//! decoding its replies, and its `impl Store` methods. Changing a script's arguments or
//! reply touches its Lua file and its file here; adding one also adds its name to the
//! list in `scripts.rs`. The machinery every operation shares (transport, keys, reply
//! reader, durability, the topics registry) stays in the files of `store/`.
//!
//! - `apply.rs`: the command batch (put and delete in order, fenced by an ingest epoch,
//!   registering new topics, waiting for replicas); `put.rs` and `delete.rs` build
//!   and decode its two scripts' calls;
//! - `ingest.rs`: ingest's epochs, members and command partition count;
//! - `reserve.rs`: reserve (one topic or many) and pull; `release.rs`: every release;
//!   `retry.rs`: handing a job back after a failed delivery; `requeue.rs`: expired
//!   reservations made due again;
//! - `get.rs`, `stats.rs`, `list.rs`, `history.rs`, `due_histogram.rs`: the reads;
//!   `topics.rs`: the topics set and each topic's next due time; `server.rs`: the
//!   server's clock and `PING`;
//! - `pause.rs`, `redrive.rs`, `redrive_window.rs` (by last-failure time, with a
//!   cursor), `rate_limit.rs`, `delete_prefix.rs`, `check.rs`: the operator's tools;
//! - `target_health.rs`: a webhook target's circuit breaker, shared by every bridge.

mod apply;
mod check;
mod delete;
mod delete_prefix;
mod due_histogram;
mod get;
mod history;
mod ingest;
mod list;
mod pause;
mod put;
mod rate_limit;
mod redrive;
mod redrive_window;
mod release;
mod requeue;
mod reserve;
mod retry;
mod server;
mod stats;
mod target_health;
mod topics;

pub use apply::{Applied, Command, Op};
pub use check::{CheckReport, Problem, CHECK_STEP};
pub use delete_prefix::{PrefixStep, PREFIX_STEP};
pub use due_histogram::{DueHistogram, MAX_HISTOGRAM_BUCKETS, MAX_HISTOGRAM_WINDOW_MS};
pub use get::JobInfo;
pub use history::{HistoryEntry, Outcome};
pub use ingest::RecordedPartitions;
pub use list::{JobSummary, ListWhich};
pub use put::{PutOutcome, PutRequest, PutStatus};
pub use rate_limit::{RateSource, RateState};
pub use redrive::Redriven;
pub use redrive_window::WindowStep;
pub use release::{Delivered, Expired, NextDue, Noted};
pub use requeue::Requeued;
pub use reserve::{Batch, ReservedJob};
pub use retry::RetryOutcome;
pub use stats::TopicStats;
pub use target_health::{HealthOp, TargetHealth};

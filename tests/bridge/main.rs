//! Tests of a running bridge end to end over AMQP on the real Redis and RabbitMQ: the wire
//! contract, each scheduler feature as the bridge delivers it (parking, pause, expiry, recurring
//! series and their punctuality, jitter, rate limits, webhooks, a third sink of the test's own,
//! partitions, cancel by prefix, trace context and span export), producers and examples in other languages, and bad or hostile
//! input.
//!
//! One binary with one module per feature (`cargo test --test bridge <module>::`): one link
//! of the library for all of them.

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod cancel_by_prefix;
mod decode_fuzz;
mod end_to_end;
mod examples;
mod expiry;
mod jitter;
mod lanes;
mod log_volume;
mod parking;
mod partitions;
mod poison;
mod producers;
mod rate_limits;
mod recurring;
mod scale;
mod subscription;
mod target_health;
mod third_sink;
mod trace_context;
mod trace_spans;
mod webhook_identity;
mod webhook_urls;
mod webhooks;

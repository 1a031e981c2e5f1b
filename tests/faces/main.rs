//! Tests of the operator faces against a real Redis: the `redisched` CLI, the REST API and its
//! hardening, the dashboard in a headless browser, charts, the OpenAPI document, `/metrics`,
//! what never reaches a log, and a topic held by its webhook target's breaker.
//!
//! One binary with one module per feature (`cargo test --test faces <module>::`): one link
//! of the library for all of them.

#[path = "../common/mod.rs"]
mod common;

mod charts;
mod cli;
mod dashboard;
mod features_cli;
mod features_http;
mod held_by;
mod http_api;
mod http_hardening;
mod metrics;
mod openapi;
mod pause;
mod security;
mod target_redrive;

//! Tests at the scripts' boundary: every script of `lua/` driven through the typed `Store`,
//! raw, and from a client with no Rust glue (the scripts are the API); format versioning.
//!
//! One binary with one module per feature (`cargo test --test lua <module>::`): one link
//! of the library for all of them.

#[path = "../common/mod.rs"]
mod common;

mod lua_features;
mod lua_other_client;
mod store_scripts;
mod target_health;

//! Tests at the store's boundary against real Redis topologies and states: the smoke and
//! model tests of `Store`, the topics registry, Redis Cluster, replicas, eviction and OOM,
//! `redisched check` on keys in an unexpected state, and the webhook targets' breakers read
//! at once.
//!
//! One binary with one module per feature (`cargo test --test store <module>::`): one link
//! of the library for all of them.

#[path = "../common/mod.rs"]
mod common;

mod check;
mod cluster;
mod redis_health;
mod redrive_window;
mod replication;
mod store_model;
mod store_smoke;
mod target_health;
mod topic_registry;

//! Fault tests: the bridge under crashes, restarts, alarms and network faults of private
//! services (a private `redis-server`, RabbitMQ node or cluster, TLS-only servers), and a
//! bounded soak. They never stop or alarm the shared Redis and RabbitMQ.
//!
//! One binary with one module per feature (`cargo test --test faults <module>::`): one link
//! of the library for all of them.

#[path = "../common/mod.rs"]
mod common;

mod bridge_faults;
mod lost_connection;
mod partition_restart;
mod rabbit_cluster;
mod soak;
mod tls;

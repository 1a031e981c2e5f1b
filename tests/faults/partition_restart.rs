//! Command partitions across a broker restart: does every job id stay on its partition?
//!
//! Partitioned ingest keeps a job's commands in order only because one id always goes
//! to one partition queue (README, *Partitioned commands*). The release before routed
//! through RabbitMQ's consistent-hash exchange, whose ring is kept in memory and rebuilt
//! at boot in the order the broker's worker pool re-adds the bindings: on RabbitMQ
//! 3.10.8, 241–347 of 400 ids landed in another partition after one restart, and two
//! lanes then applied one id's commands at once. Now the bridge's router picks the
//! partition ([`redisched::amqp::partition_of`]). This test declares the partitioned
//! topology on a private node, routes a set of ids with the router itself, reads back
//! which queue each landed in, restarts the node's app (`stop_app` / `start_app`, as
//! `tests/chaos.rs` does) a few times and routes the same ids again after each restart.

use crate::common;

use std::collections::BTreeMap;

use common::faults::*;
use futures_util::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

const PARTITIONS: u16 = 8;
const IDS: usize = 400;
const RESTARTS: usize = 4;

async fn open(url: &str) -> (Connection, Channel) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect to the private node");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    (connection, channel)
}

/// Publishes one message per id through the commands exchange, as a producer does,
/// forwards them with the bridge's router, then takes every partition queue empty:
/// which partition each id landed in.
async fn route(
    connection: &Connection,
    channel: &Channel,
    config: &redisched::config::Config,
) -> BTreeMap<String, u16> {
    let amqp = &config.amqp;
    for i in 0..IDS {
        let id = format!("job-{i}");
        let props = BasicProperties::default().with_message_id(id.as_str().into());
        channel
            .basic_publish(
                amqp.commands_exchange.as_str().into(),
                "t".into(),
                BasicPublishOptions::default(),
                b"{}",
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
    }
    common::route::route_everything(connection, &config.amqp).await;
    // Single-active-consumer quorum queues refuse basic.get: a consumer per queue takes
    // as many messages as the queue holds (every publish was confirmed).
    let mut landed = BTreeMap::new();
    for k in 0..PARTITIONS {
        let queue = redisched::amqp::partition_queue(amqp, k);
        let depth = queue_depth(channel, &queue).await.expect("queue depth");
        let tag = format!("read-{k}");
        let options = BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        };
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                options,
                FieldTable::default(),
            )
            .await
            .expect("basic.consume");
        let taken: Vec<_> = consumer.take(depth as usize).collect().await;
        for delivery in taken {
            let delivery = delivery.expect("delivery");
            let id = delivery
                .properties
                .message_id()
                .as_ref()
                .map(ToString::to_string)
                .expect("message_id");
            landed.insert(id, k);
        }
        channel
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
            .await
            .expect("basic.cancel");
    }
    assert_eq!(landed.len(), IDS, "every id landed in one partition");
    landed
}

#[test]
#[ignore = "slow: bash scripts/test.sh runs it"]
fn a_broker_restart_keeps_every_id_on_its_partition() {
    bounded(FAULT_TEST_LIMIT, async {
        init_logging();
        let node = PrivateRabbit::start().unwrap_or_else(|e| panic!("private RabbitMQ node: {e}"));
        let mut config = fault_config("chxrestart");
        config.amqp.command_partitions = PARTITIONS;
        config.amqp.url = node.url();
        let (connection, channel) = open(&node.url()).await;
        redisched::amqp::declare_topology(&channel, &config.amqp)
            .await
            .expect("declare the partitioned topology");
        let before = route(&connection, &channel, &config).await;
        for (id, k) in &before {
            assert_eq!(
                *k,
                redisched::amqp::partition_of(id.as_bytes(), PARTITIONS),
                "{id}"
            );
        }
        drop((channel, connection));
        for restart in 1..=RESTARTS {
            node.ctl_ok(&["stop_app"]);
            node.ctl_ok(&["start_app"]);
            let (connection, channel) = open(&node.url()).await;
            let after = route(&connection, &channel, &config).await;
            let moved: BTreeMap<u16, BTreeMap<u16, usize>> =
                before.iter().fold(BTreeMap::new(), |mut moved, (id, k)| {
                    if after[id] != *k {
                        *moved.entry(*k).or_default().entry(after[id]).or_default() += 1;
                    }
                    moved
                });
            let count: usize = moved.values().flat_map(BTreeMap::values).sum();
            println!("[chxrestart] after restart {restart}: {count} of {IDS} ids on another partition (from -> to: count) {moved:?}");
            assert_eq!(
            count, 0,
            "restart {restart} moved {count} of {IDS} ids to another partition (from -> to: count): {moved:?}"
        );
        }
    });
}

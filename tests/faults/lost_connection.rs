//! A stage whose AMQP connection dies under it ends (`amqp::while_connected`): with its
//! own error when it notices, and after the grace period when it waits on a call that
//! would never complete (lapin was seen leaving an ack pending for good when the broker
//! force-closed the connection).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use redisched::amqp::{while_connected, AmqpError};

use crate::common;
use common::faults::*;

async fn through_proxy() -> (Proxy, Connection) {
    let proxy = Proxy::start(socket_addr(&common::amqp_url())).await;
    let connection = Connection::connect(&proxy.amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "AMQP through the proxy ({e}); {}",
                common::HOW_TO_START_RABBITMQ
            )
        });
    (proxy, connection)
}

#[test]
fn a_stage_stuck_on_a_dead_connection_is_stopped_after_the_grace_period() {
    bounded(FAULT_TEST_LIMIT, async {
        let (proxy, connection) = through_proxy().await;
        let grace = Duration::from_secs(2);
        let cut = async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            proxy.cut();
            Instant::now()
        };
        // A stage awaiting what never comes, as one awaiting an ack lapin never completes.
        let stuck = std::future::pending::<Result<(), AmqpError>>();
        let bounded = tokio::time::timeout(
            Duration::from_secs(15),
            while_connected(&connection, stuck, grace),
        );
        let (ended, cut_at) = tokio::join!(bounded, cut);
        let after = cut_at.elapsed();
        eprintln!("stuck stage stopped {after:?} after the cut (grace {grace:?})");
        assert!(
            matches!(ended, Ok(Err(AmqpError::Lost(g))) if g == grace),
            "ended with {ended:?}"
        );
        assert!(
            after >= grace && after < grace + Duration::from_secs(3),
            "stopped {after:?} after the cut (grace {grace:?})"
        );
    });
}

#[test]
fn a_stage_that_sees_the_loss_keeps_its_own_error_and_one_that_ends_is_untouched() {
    bounded(FAULT_TEST_LIMIT, async {
        let (proxy, connection) = through_proxy().await;
        let done = while_connected(&connection, async { Ok(7) }, Duration::from_secs(2)).await;
        assert!(matches!(done, Ok(7)), "{done:?}");

        let channel = connection.create_channel().await.expect("channel");
        let exclusive = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        };
        let queue = channel
            .queue_declare("".into(), exclusive, FieldTable::default())
            .await
            .expect("declare");
        let mut consumer = channel
            .basic_consume(
                queue.name().as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let stage = async move {
            match consumer.next().await {
                Some(Err(err)) => Err::<(), _>(AmqpError::Broker(err)),
                other => panic!(
                    "expected the consumer to fail, got {:?}",
                    other.map(|d| d.map(|_| ()))
                ),
            }
        };
        let cut = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            proxy.cut();
        };
        let started = Instant::now();
        let (ended, ()) = tokio::join!(
            while_connected(&connection, stage, Duration::from_secs(10)),
            cut
        );
        assert!(
            matches!(ended, Err(AmqpError::Broker(_))),
            "ended with {ended:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "ended at once, not after the grace"
        );
    });
}

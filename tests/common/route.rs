//! Partitioned commands: the bridge's own router run in the test's process.

use std::time::{Duration, Instant};

use lapin::Connection;
use redisched::config::AmqpConfig;
use redisched::ingest::{route_commands, Routed};

/// Forwards what the route queue holds with the bridge's own router, in this process
/// and with no lane consuming, so a test can read where each command went. Returns once
/// the route queue is empty and every forward was acked.
pub async fn route_everything(connection: &Connection, config: &AmqpConfig) {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let route = redisched::amqp::route_queue(config);
    let router = route_commands(connection, config, 100, false, &shutdown);
    let watch = async {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = redisched::amqp::queue_state(connection, &route)
                .await
                .unwrap_or_else(|err| panic!("look at {route}: {err}"));
            if state.is_some_and(|(ready, _)| ready == 0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the router did not empty {route}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Every forward is acked by then or soon (a confirm, then the router's settle).
        tokio::time::sleep(Duration::from_millis(300)).await;
        shutdown.cancel();
    };
    let (routed, ()) = tokio::join!(router, watch);
    assert_eq!(routed.expect("router session"), Routed::Shutdown);
}

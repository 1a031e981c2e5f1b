//! Operational events: each change of a webhook target's health
//! ([`Change`]) published to the durable topic exchange `redisched.events` with routing
//! key `target.<state>` and a JSON body `{"target","state","reason","at"}`, so that
//! operators can alert on it. The webhook sink hands changes over through a bounded
//! queue ([`EventSender`]); one task here publishes them with publisher confirms on a
//! connection of its own (the AMQP transport of `crate::amqp`). If the broker is down
//! the event is logged and dropped: the state itself is in Redis, the API and the
//! metrics.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::AmqpConfig;
use crate::targets::health::Change;

/// The exchange the events go to.
pub const EXCHANGE: &str = "redisched.events";
/// Events waiting for the publisher; beyond it they are logged and dropped.
const QUEUE: usize = 1024;
/// How long one publish (with its confirm) may take.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the webhook sink puts each change it announces.
pub type EventSender = mpsc::Sender<Change>;

/// The sender for the sink and the receiver for [`publish_events`].
pub fn queue() -> (EventSender, mpsc::Receiver<Change>) {
    mpsc::channel(QUEUE)
}

/// Publishes every change that arrives until shutdown (or every sender is gone),
/// connecting at the first one and again after a failure.
pub async fn publish_events(
    config: AmqpConfig,
    mut changes: mpsc::Receiver<Change>,
    shutdown: CancellationToken,
) {
    // Declared at start (if the broker answers), so consumers can bind before the
    // first change; a failure here is retried at the first event.
    let mut attempt = 1usize;
    let mut link = match tokio::time::timeout(PUBLISH_TIMEOUT, open(&config, attempt)).await {
        Ok(Ok(opened)) => Some(opened),
        _ => None,
    };
    loop {
        let change = tokio::select! {
            () = shutdown.cancelled() => break,
            change = changes.recv() => match change {
                Some(change) => change,
                None => break,
            },
        };
        if link.is_none() {
            attempt += 1;
            match tokio::time::timeout(PUBLISH_TIMEOUT, open(&config, attempt)).await {
                Ok(Ok(opened)) => link = Some(opened),
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, target = %change.target, state = %change.to, "cannot reach the broker for the events exchange; event not published (the state is in Redis, the API and the metrics)")
                }
                Err(_) => {
                    tracing::warn!(target = %change.target, state = %change.to, "connecting for the events exchange timed out; event not published")
                }
            }
        }
        let Some((_, channel)) = &link else {
            continue;
        };
        match tokio::time::timeout(PUBLISH_TIMEOUT, publish(channel, &change)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::warn!(error = %err, target = %change.target, state = %change.to, "event not published to redisched.events");
                link = None;
            }
            Err(_) => {
                tracing::warn!(target = %change.target, state = %change.to, "event publish to redisched.events timed out");
                link = None;
            }
        }
    }
    if let Some((connection, _)) = link {
        crate::amqp::close_quietly("events connection", connection.close(200, "bye".into())).await;
    }
}

/// A connection and a confirm channel, with the exchange declared.
async fn open(config: &AmqpConfig, attempt: usize) -> Result<(Connection, Channel), String> {
    let (connection, _) = crate::amqp::connect(config, "redisched events", attempt)
        .await
        .map_err(|e| e.to_string())?;
    let channel = crate::amqp::confirm_channel(&connection)
        .await
        .map_err(|e| e.to_string())?;
    channel
        .exchange_declare(
            EXCHANGE.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok((connection, channel))
}

/// One event, persistent, JSON; `Ok` once the broker confirmed it.
async fn publish(channel: &Channel, change: &Change) -> Result<(), String> {
    let body = serde_json::to_vec(change).map_err(|e| e.to_string())?;
    let key = routing_key(change);
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    let confirm = channel
        .basic_publish(
            EXCHANGE.into(),
            key.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            props,
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    if confirm.is_nack() {
        return Err("the broker refused it (nack)".into());
    }
    Ok(())
}

/// `target.<state>`.
pub fn routing_key(change: &Change) -> String {
    format!("target.{}", change.to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_routed_by_its_state_and_carries_the_four_fields() {
        let change = Change {
            target: "billing".into(),
            to: "disabled".into(),
            reason: "the target answered 410 Gone".into(),
            at: "2026-01-01T00:00:00.000Z".into(),
        };
        assert_eq!(routing_key(&change), "target.disabled");
        let json: serde_json::Value =
            serde_json::from_slice(&serde_json::to_vec(&change).unwrap_or_default())
                .unwrap_or_default();
        assert_eq!(json["target"], "billing");
        assert_eq!(json["state"], "disabled");
        assert_eq!(json["reason"], "the target answered 410 Gone");
        assert_eq!(json["at"], "2026-01-01T00:00:00.000Z");
    }
}

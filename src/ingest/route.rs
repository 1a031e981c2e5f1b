//! The router of partitioned commands (`amqp.command_partitions` = N > 1). Producers
//! publish to the commands exchange as always; it feeds one queue, the route queue
//! (single active consumer), and the bridge holding it forwards each command, in
//! delivery order, to partition [`amqp::partition_of`]`(job id, N)`, acking it only once
//! the broker confirmed the forward. The partition of an id is redisched's own function
//! of the id and N, so a broker restart cannot move it (RabbitMQ's consistent-hash
//! exchange, used before, rebuilt its ring in another order at boot, and two partitions
//! then applied one id's commands at once).
//!
//! Order: one consumer forwards on one channel, in delivery order, so one id's commands
//! reach its partition in publish order. A router that goes leaves its unacked commands
//! to the next one, which forwards them again: a suffix of the stream repeated in order,
//! applied again in order, as with one queue when a bridge dies before its ack.
//!
//! Returns: a forward is `mandatory`; the broker returns it when its partition's queue
//! is gone. lapin may hand a return to another publish's confirm of the same window
//! (`dispatch/amqp/confirm.rs`), so any return ends the session before anything after the
//! acks already sent is acked: the unacked commands go back to the route queue, and
//! the next session declares the topology again.

use std::collections::VecDeque;
use std::time::Duration;

use futures_util::stream::FuturesOrdered;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions};
use lapin::types::FieldTable;
use lapin::Acker;
use lapin::{Confirmation, Connection};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::isolation::{why_ended, Careful, ISOLATION_IDLE};
use crate::amqp::{self, AmqpError};
use crate::config::AmqpConfig;

/// How long a confirmed forward waits before its command is acked, so that a return
/// lapin paired with a confirm resolved a moment later is seen first. It costs no
/// lateness: the command is already in its partition.
const SETTLE: Duration = Duration::from_millis(5);
// A careful session (one command at a time, after an unparseable message ended the
// last one: `isolation.rs`) returns to the full window once the route queue is empty,
// or once it forwarded a full window one by one.

/// How one router session ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Routed {
    /// Shutdown: everything forwarded was acked.
    Shutdown,
    /// A careful session found the route queue empty: the next may take a full window.
    Recovered,
}

/// One router session on `connection` until shutdown, a broker error, or (`careful`:
/// one command at a time) until the route queue is empty. `window` bounds the commands
/// forwarded and not yet acked.
pub async fn route_commands(
    connection: &Connection,
    config: &AmqpConfig,
    window: u16,
    careful: bool,
    shutdown: &CancellationToken,
) -> Result<Routed, AmqpError> {
    let full_window = usize::from(window.max(1));
    let window = if careful { 1 } else { window.max(1) };
    let mut careful = Careful::new(careful, full_window);
    let input = amqp::consumer_channel(connection, window).await?;
    let output = amqp::confirm_channel(connection).await?;
    let queue = amqp::route_queue(config);
    let tag = format!("redisched-route-{}", std::process::id());
    let mut consumer = input
        .basic_consume(
            queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let exchanges: Vec<String> = (0..config.command_partitions)
        .map(|k| amqp::partition_exchange(config, k))
        .collect();
    tracing::info!(queue = %queue, partitions = config.command_partitions, careful = careful.is_on(), "routing commands to their partitions");
    let mut forwarding = FuturesOrdered::new();
    let mut settling: VecDeque<(Acker, Instant)> = VecDeque::new();
    let mut draining = false;
    let mut last_delivery = Instant::now();
    let ended = loop {
        let idle = forwarding.is_empty() && settling.is_empty();
        if draining && idle {
            break Ok(Routed::Shutdown);
        }
        if idle && careful.window_done() {
            break Ok(Routed::Recovered);
        }
        let settle_at = settling.front().map(|(_, at)| *at + SETTLE);
        tokio::select! {
            biased;
            _ = shutdown.cancelled(), if !draining => draining = true,
            Some((acker, confirmed)) = forwarding.next() => {
                if let Err(err) = forwarded(confirmed, &queue) {
                    break Err(err);
                }
                settling.push_back((acker, Instant::now()));
                careful.done(1);
            }
            () = sleep_until(settle_at), if settle_at.is_some() => {
                if let Err(err) = ack_settled(&mut settling).await {
                    break Err(err);
                }
            }
            next = consumer.next(), if !draining && forwarding.len() < usize::from(window) => {
                let delivery = match next {
                    Some(Ok(delivery)) => delivery,
                    Some(Err(err)) => break Err(err.into()),
                    None => break Err(AmqpError::Broker(lapin::ErrorKind::InvalidChannelState(
                        lapin::ChannelState::Closed, "route consumer cancelled by the broker").into())),
                };
                last_delivery = Instant::now();
                careful.delivered();
                match forward(&output, &exchanges, delivery).await {
                    Ok(pending) => forwarding.push_back(pending),
                    Err(err) => break Err(err),
                }
            }
            () = tokio::time::sleep_until(last_delivery + ISOLATION_IDLE), if careful.is_on() && idle && !draining => {
                last_delivery = Instant::now();
                match careful.queue_empty(connection, &queue).await {
                    Ok(true) => break Ok(Routed::Recovered),
                    Ok(false) => {}
                    Err(err) => break Err(err),
                }
            }
        }
    };
    // An end met while forwarding or acking is an unparseable message's when that is what
    // ended the connection (`isolation.rs`).
    let ended = why_ended(ended, &input, &mut consumer).await;
    // No basic.cancel first (see `session.rs`): closing the channel returns what it
    // holds unacked and hands the route queue over in one step.
    amqp::close_quietly("router channels", async {
        input.close(200, "shutdown".into()).await.ok();
        output.close(200, "shutdown".into()).await.ok();
    })
    .await;
    ended
}

/// Publishes `delivery` to its partition's exchange, body, properties and routing key
/// (the topic) intact; resolves to its acker and the broker's confirm.
async fn forward(
    output: &lapin::Channel,
    exchanges: &[String],
    delivery: Delivery,
) -> Result<impl std::future::Future<Output = (Acker, lapin::Result<Confirmation>)>, AmqpError> {
    // A command without a usable id still goes somewhere (partition of the empty id),
    // where its lane sets it aside with the reason.
    let id = crate::job::meta::job_id(&delivery.properties)
        .ok()
        .flatten();
    let k = amqp::partition_of(
        id.as_deref().unwrap_or("").as_bytes(),
        partitions(exchanges),
    );
    let exchange = &exchanges[usize::from(k)];
    let confirm = output
        .basic_publish(
            exchange.as_str().into(),
            delivery.routing_key.clone(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &delivery.data,
            delivery.properties.clone(),
        )
        .await?;
    let acker = delivery.acker;
    Ok(async move { (acker, confirm.await) })
}

fn partitions(exchanges: &[String]) -> u16 {
    u16::try_from(exchanges.len()).unwrap_or(u16::MAX)
}

/// What a forward's confirm says: confirmed, or the end of the session.
fn forwarded(confirmed: lapin::Result<Confirmation>, queue: &str) -> Result<(), AmqpError> {
    match confirmed? {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(AmqpError::Topology(format!(
            "the broker returned a command forwarded from {queue} ({}): a command partition's queue is missing; declaring the topology again",
            returned.reply_text
        ))),
        Confirmation::Nack(_) => Err(AmqpError::NotConfirmed {
            exchange: format!("the command partitions (forwarding from {queue})"),
        }),
    }
}

/// Acks, with one cumulative ack, every command whose forward was confirmed at least
/// [`SETTLE`] ago.
async fn ack_settled(settling: &mut VecDeque<(Acker, Instant)>) -> Result<(), AmqpError> {
    let now = Instant::now();
    let mut last = None;
    while settling.front().is_some_and(|(_, at)| *at + SETTLE <= now) {
        last = settling.pop_front().map(|(acker, _)| acker);
    }
    if let Some(acker) = last {
        acker.ack(BasicAckOptions { multiple: true }).await?;
    }
    Ok(())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

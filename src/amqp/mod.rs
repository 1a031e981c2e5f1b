//! The AMQP transport shared by ingest and dispatch: connecting (a node list tried in
//! turn, TLS, the frame cap), `while_connected` (a stage on a dead connection is stopped
//! after a grace period), declaring the topology (with command partitions: the route
//! queue, a fanout exchange and a queue per partition, [`partition_of`]; probing and
//! retiring a previous topology's queues), channels and the error type. A job's
//! vocabulary on the wire (header names, the stored meta) is `crate::job`'s: this module
//! never decodes a job's meta (`tests/tidy.rs`).

use std::future::Future;
use std::time::Duration;

use lapin::options::{
    BasicQosOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    ExchangeUnbindOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

use crate::config::AmqpConfig;
/// The largest frame either connection negotiates (RabbitMQ's default `frame_max`). A
/// content header must fit in one frame, so on a broker with the default setting this
/// also bounds the deepest header a command can carry (the broker refuses a larger
/// frame from a publisher); the threads that parse and drop deliveries get a stack
/// measured to hold that depth (`src/main.rs`). Without a cap, a broker offering
/// `frame_max = 0` (unlimited) would make lapin size its buffers for 4 GiB frames.
pub const FRAME_MAX: u32 = 131_072;

/// The AMQP error boundary.
#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    #[error("invalid AMQP URL ({0})")]
    Url(String),
    #[error("AMQP: {0}")]
    Broker(#[from] lapin::Error),
    #[error("AMQP: {0}")]
    Timeout(&'static str),
    #[error("AMQP session ended unexpectedly")]
    Ended,
    #[error("AMQP TLS: {0}")]
    Tls(String),
    /// The broker refused a publish the bridge must not lose (set-aside commands).
    #[error("the broker did not confirm the publish to {exchange}")]
    NotConfirmed { exchange: String },
    /// The broker's commands topology does not fit the configuration.
    #[error("AMQP topology: {0}")]
    Topology(String),
    /// The connection was lost and the stage on it had not ended after the grace
    /// period of [`while_connected`]: it waited on a call that would never complete.
    #[error(
        "AMQP connection lost; the stage on it was still waiting after {0:?}, so it was stopped"
    )]
    Lost(Duration),
}

impl AmqpError {
    /// Whether the session ended because the client library could not parse what the
    /// broker sent (a delivery with a `message_id` that is not UTF-8, a header frame
    /// larger than [`FRAME_MAX`]): the broker is fine, one message is not.
    pub fn is_unparseable(&self) -> bool {
        let AmqpError::Broker(err) = self else {
            return false;
        };
        match err.kind() {
            lapin::ErrorKind::ParsingError(_) => true,
            lapin::ErrorKind::ProtocolError(e) => matches!(
                e.kind(),
                lapin::protocol::AMQPErrorKind::Hard(lapin::protocol::AMQPHardError::FRAMEERROR)
            ),
            _ => false,
        }
    }
}

/// How long a polite goodbye (`basic.cancel`, `channel.close`, `connection.close`) may
/// wait for the broker. Each of them waits for the broker's reply, so a broker that
/// stopped answering (a hung node, a black-holed network) held up shutdown until the
/// heartbeat timeout declared the connection dead (two heartbeats, 20 s by default;
/// found by `tests/faults/bridge_faults.rs`, SIGTERM with the broker hung). Closing is best effort
/// anyway: whatever was not acked is requeued by the broker when the socket goes.
pub const CLOSE_TIMEOUT: Duration = crate::shutdown::AMQP_CLOSE;

/// How long [`channel_confirmed_open`] waits for the broker's answer.
const CONFIRM_OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether the broker still has `channel` open, by a round trip on it (a passive declare
/// of `amq.direct`, which every vhost has and none can delete): the client's own view
/// of a channel lags the broker's by up to a heartbeat timeout when a link stalls.
/// While the broker has the channel open, the deliveries it holds unacked are given to
/// no other consumer. No answer within `CONFIRM_OPEN_TIMEOUT` counts as closed.
pub async fn channel_confirmed_open(channel: &Channel) -> bool {
    let declare = channel.exchange_declare(
        "amq.direct".into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        },
        FieldTable::default(),
    );
    matches!(
        tokio::time::timeout(CONFIRM_OPEN_TIMEOUT, declare).await,
        Ok(Ok(()))
    )
}

/// Runs `stage` (the work of one session on `connection`) to its end, unless the
/// connection is lost and the stage has not ended `grace` later: then it is dropped and
/// the answer is [`AmqpError::Lost`]. A stage normally sees the loss at once (its next
/// delivery or call fails) and ends with its own error, which is returned as it is (an
/// unparseable message keeps its meaning). But lapin can leave a call on a dead
/// connection pending for good: an ack sent while the broker force-closed the
/// connection for a restart was seen never to complete, and a session awaiting it
/// would stall its stage until the process restarts.
pub async fn while_connected<T>(
    connection: &Connection,
    stage: impl Future<Output = Result<T, AmqpError>>,
    grace: Duration,
) -> Result<T, AmqpError> {
    let mut stage = std::pin::pin!(stage);
    let lost = async {
        let mut every = tokio::time::interval(Duration::from_millis(500));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            if !connection.status().connected() {
                return;
            }
        }
    };
    tokio::select! {
        ended = &mut stage => ended,
        () = lost => match tokio::time::timeout(grace, &mut stage).await {
            Ok(ended) => ended,
            Err(_) => Err(AmqpError::Lost(grace)),
        },
    }
}

/// Runs a closing step for at most [`CLOSE_TIMEOUT`], ignoring its outcome.
pub async fn close_quietly<T>(what: &'static str, step: impl Future<Output = T>) {
    if tokio::time::timeout(CLOSE_TIMEOUT, step).await.is_err() {
        tracing::warn!(what, timeout = ?CLOSE_TIMEOUT, "the broker did not answer; closing anyway");
    }
}

/// Opens a connection named `name` (shown in the broker's connection list) to the first
/// broker of `amqp.url` that answers, and returns it with the (redacted) URL used.
///
/// `amqp.url` may list several brokers, comma-separated (the nodes of a cluster). They
/// are tried in order starting at index `start` (modulo their number), wrapping around:
/// the caller passes a count that grows on each reconnect, so a reconnect after a node
/// loss starts with the next node instead of waiting on the lost one first. A single
/// URL behaves exactly as before.
pub async fn connect(
    config: &AmqpConfig,
    name: &str,
    start: usize,
) -> Result<(Connection, String), AmqpError> {
    let urls = crate::urls::amqp_urls(&config.url);
    if urls.is_empty() {
        return Err(AmqpError::Url("no AMQP URL".into()));
    }
    let mut last_error = None;
    for i in 0..urls.len() {
        let url = urls[(start + i) % urls.len()];
        match connect_one(config, url, name).await {
            Ok(connection) => return Ok((connection, crate::urls::redact_url(url))),
            Err(err) => {
                if urls.len() > 1 {
                    tracing::warn!(url = %crate::urls::redact_url(url), error = %err, "cannot connect to this broker; trying the next");
                }
                last_error = Some(err);
            }
        }
    }
    Err(last_error.unwrap_or(AmqpError::Ended))
}

async fn connect_one(config: &AmqpConfig, url: &str, name: &str) -> Result<Connection, AmqpError> {
    let mut uri: lapin::uri::AMQPUri = url.parse().map_err(AmqpError::Url)?;
    uri.query.heartbeat = Some(config.heartbeat_secs);
    // The lower of the URL's frame_max (if any) and the cap; lapin then negotiates the
    // lower of that and the broker's.
    uri.query.frame_max = Some(
        uri.query
            .frame_max
            .filter(|&given| given > 0)
            .map_or(FRAME_MAX, |given| given.min(FRAME_MAX)),
    );
    // Without a timeout a black-holed broker address would hang the connect forever.
    uri.query.connection_timeout.get_or_insert(10_000);
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    // amqps:// (TLS) with the CAs of `amqp.tls_ca_file` trusted besides the system roots.
    let Some(ca_file) = crate::tls::ca_file(&config.tls_ca_file) else {
        return Ok(Connection::connect_uri(uri, properties).await?);
    };
    let tls =
        crate::tls::amqp_tls_config(Some(ca_file)).map_err(|e| AmqpError::Tls(e.to_string()))?;
    let runtime = lapin::runtime::default_runtime()?;
    Ok(Connection::connect_uri_with_config(uri, properties, tls, runtime).await?)
}

/// Declares exchanges, queues and bindings (idempotent). Queue arguments must match an
/// existing queue's, or the broker refuses with PRECONDITION_FAILED, which we report.
///
/// With `amqp.command_partitions` = N > 1 the commands exchange feeds the route queue
/// [`route_queue`] instead of the one commands queue, and the router forwards each
/// command to one of the N queues [`partition_queue`] (see `declare_partitions`);
/// everything else is as with one queue.
pub async fn declare_topology(channel: &Channel, config: &AmqpConfig) -> lapin::Result<()> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    for exchange in [
        &config.commands_exchange,
        &config.invalid_exchange,
        &config.expired_exchange,
        &config.ready_exchange,
    ] {
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await?;
    }
    let commands_args = commands_queue_args(config);
    let mut invalid_args = FieldTable::default();
    let mut expired_args = FieldTable::default();
    if config.quorum_queues {
        for args in [&mut invalid_args, &mut expired_args] {
            args.insert("x-queue-type".into(), text("quorum"));
        }
    }
    let durable_queue = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let mut queues = vec![
        (
            config.invalid_queue.clone(),
            config.invalid_exchange.clone(),
            invalid_args,
            "#".to_string(),
        ),
        (
            config.expired_queue.clone(),
            config.expired_exchange.clone(),
            expired_args,
            "#".to_string(),
        ),
    ];
    if config.command_partitions > 1 {
        queues.extend(declare_partitions(channel, config, &commands_args).await?);
    } else {
        queues.push((
            config.commands_queue.clone(),
            config.commands_exchange.clone(),
            commands_args,
            "#".to_string(),
        ));
    }
    for (queue, exchange, args, key) in queues {
        channel
            .queue_declare(queue.as_str().into(), durable_queue, args)
            .await?;
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// The partitioned commands' part of the topology: the route queue on the commands
/// exchange (`#`, the commands queue's arguments: single active consumer, so one
/// bridge forwards at a time), and per partition `k` a fanout exchange
/// [`partition_exchange`] bound to the queue [`partition_queue`]. The router forwards
/// each command to its partition's exchange with the command's own routing key (its
/// topic). The consistent-hash exchange of the release before is deleted: it kept
/// its ring in memory and rebuilt it in another order at a broker restart, moving ids
/// between partitions (the book's *Partitioned commands*, `docs/src/partitions.md`).
async fn declare_partitions(
    channel: &Channel,
    config: &AmqpConfig,
    commands_args: &FieldTable,
) -> lapin::Result<Vec<(String, String, FieldTable, String)>> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    // Idempotent on RabbitMQ: deleting an exchange that does not exist succeeds.
    channel
        .exchange_delete(
            hash_exchange(config).as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await?;
    let mut queues = vec![(
        route_queue(config),
        config.commands_exchange.clone(),
        commands_args.clone(),
        "#".to_string(),
    )];
    for k in 0..config.command_partitions {
        let exchange = partition_exchange(config, k);
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Fanout,
                durable,
                FieldTable::default(),
            )
            .await?;
        queues.push((
            partition_queue(config, k),
            exchange,
            commands_args.clone(),
            String::new(),
        ));
    }
    Ok(queues)
}

/// The arguments of the commands queue, and of each command partition's queue.
pub fn commands_queue_args(config: &AmqpConfig) -> FieldTable {
    let mut args = FieldTable::default();
    if config.single_active_consumer {
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    if config.quorum_queues {
        args.insert("x-queue-type".into(), text("quorum"));
        // A poison command (one the client library cannot even parse, e.g. a message_id
        // that is not UTF-8) drops the connection before the bridge sees it; without a
        // limit it would be redelivered forever and block every command behind it.
        // After `delivery_limit` deliveries the broker dead-letters it, at least once,
        // to the invalid exchange (reason in its `x-death` header).
        if config.delivery_limit > 0 {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(config.delivery_limit)),
            );
            args.insert(
                "x-dead-letter-exchange".into(),
                text(&config.invalid_exchange),
            );
            args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
            args.insert("x-overflow".into(), text("reject-publish"));
        }
    }
    args
}

/// The consistent-hash exchange the release before put between the commands exchange
/// and the partitions; deleted when the partitioned topology is declared.
pub fn hash_exchange(config: &AmqpConfig) -> String {
    format!("{}.hash", config.commands_exchange)
}

/// The queue the commands exchange feeds when commands are partitioned, consumed by
/// the router: `<commands_queue>.route`.
pub fn route_queue(config: &AmqpConfig) -> String {
    format!("{}.route", config.commands_queue)
}

/// The fanout exchange in front of command partition `k`: `<commands_exchange>.<k>`.
pub fn partition_exchange(config: &AmqpConfig, k: u16) -> String {
    format!("{}.{k}", config.commands_exchange)
}

/// The command partition of job `id` among `partitions`: FNV-1a (64-bit) of the id's
/// bytes, modulo the count. redisched's own function of the id and the count alone, so
/// it is the same on every bridge, every build and across broker restarts.
pub fn partition_of(id: &[u8], partitions: u16) -> u16 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in id {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    let k = hash % u64::from(partitions.max(1));
    u16::try_from(k).unwrap_or(0)
}

/// The queue of command partition `k`: `<commands_queue>.<k>`.
pub fn partition_queue(config: &AmqpConfig, k: u16) -> String {
    format!("{}.{k}", config.commands_queue)
}

/// Ready messages and consumers of `queue`, or `None` if it does not exist (a passive
/// declare on a channel of its own: the broker closes a channel that names a missing
/// queue).
pub async fn queue_state(
    connection: &Connection,
    queue: &str,
) -> lapin::Result<Option<(u32, u32)>> {
    let channel = connection.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    match channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(ok) => {
            close_quietly("probe channel", channel.close(200, "probed".into())).await;
            Ok(Some((ok.message_count(), ok.consumer_count())))
        }
        Err(err) if is_not_found(&err) => Ok(None),
        Err(err) => Err(err),
    }
}

/// How many command partition queues `<commands_queue>.0`, `.1`, ... exist, counting
/// up to the first missing one.
pub async fn existing_partitions(
    connection: &Connection,
    config: &AmqpConfig,
) -> lapin::Result<u16> {
    let mut k = 0u16;
    while k < crate::config::MAX_COMMAND_PARTITIONS {
        if queue_state(connection, &partition_queue(config, k))
            .await?
            .is_none()
        {
            break;
        }
        k += 1;
    }
    Ok(k)
}

/// Stops new commands from reaching `queue` (a previous topology's: the one commands
/// queue, or the route queue), on a channel of its own.
pub async fn unbind_commands_queue(
    connection: &Connection,
    config: &AmqpConfig,
    queue: &str,
) -> lapin::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .queue_unbind(
            queue.into(),
            config.commands_exchange.as_str().into(),
            "#".into(),
            FieldTable::default(),
        )
        .await
        .or_else(|err| if is_not_found(&err) { Ok(()) } else { Err(err) })?;
    close_quietly("unbind channel", channel.close(200, "unbound".into())).await;
    Ok(())
}

/// Stops new commands from reaching the partitions through the release before's
/// consistent-hash exchange, on a channel of its own.
pub async fn unbind_hash_exchange(
    connection: &Connection,
    config: &AmqpConfig,
) -> lapin::Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .exchange_unbind(
            hash_exchange(config).as_str().into(),
            config.commands_exchange.as_str().into(),
            "#".into(),
            ExchangeUnbindOptions::default(),
            FieldTable::default(),
        )
        .await
        .or_else(|err| if is_not_found(&err) { Ok(()) } else { Err(err) })?;
    close_quietly("unbind channel", channel.close(200, "unbound".into())).await;
    Ok(())
}

/// Deletes `queue` (a drained queue of a previous topology; quorum queues refuse the
/// `if-empty` and `if-unused` conditions, so the caller checks them first).
pub async fn delete_queue(connection: &Connection, queue: &str) -> lapin::Result<()> {
    let channel = connection.create_channel().await?;
    match channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
    {
        Ok(_) => {
            close_quietly("delete channel", channel.close(200, "deleted".into())).await;
            Ok(())
        }
        Err(err) if is_not_found(&err) => Ok(()),
        Err(err) => Err(err),
    }
}

fn is_not_found(err: &lapin::Error) -> bool {
    channel_error(err, lapin::protocol::AMQPSoftError::NOTFOUND)
}

fn channel_error(err: &lapin::Error, wanted: lapin::protocol::AMQPSoftError) -> bool {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => {
            matches!(e.kind(), lapin::protocol::AMQPErrorKind::Soft(soft) if *soft == wanted)
        }
        _ => false,
    }
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// A channel in publisher-confirm mode.
pub async fn confirm_channel(connection: &Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// A channel for consuming with at most `prefetch` unacked deliveries.
pub async fn consumer_channel(connection: &Connection, prefetch: u16) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    Ok(channel)
}

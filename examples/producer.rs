//! Schedules a job by the id you choose, replaces it, cancels it, then schedules another
//! (which `consumer.rs` receives). Each command waits for the broker's confirm and for the
//! bridge's reply. Run `redisched run` first, then `cargo run --example producer`.
//! Settings: AMQP_URL, COMMANDS_EXCHANGE (redisched.commands), TOPIC (emails).

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer};

type Error = Box<dyn std::error::Error>;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

/// One command at a time, for clarity: a busy producer publishes many and matches the
/// replies by `correlation_id`.
struct Producer {
    channel: Channel,
    exchange: String,
    topic: String,
    replies: Consumer,
    reply_queue: String,
}

impl Producer {
    async fn command(
        &mut self,
        op: &str,
        id: &str,
        body: &str,
        delay_ms: Option<i64>,
    ) -> Result<(), Error> {
        let mut headers = FieldTable::default();
        headers.insert(
            "x-redisched-op".into(),
            AMQPValue::LongString(LongString::from(op)),
        );
        if let Some(ms) = delay_ms {
            headers.insert("x-delay".into(), AMQPValue::LongLongInt(ms));
        }
        let correlation = format!("{op}-{id}");
        let properties = BasicProperties::default()
            .with_message_id(id.into()) // the job id you choose
            .with_content_type("text/plain".into())
            .with_headers(headers)
            .with_reply_to(self.reply_queue.as_str().into()) // where the bridge answers
            .with_correlation_id(correlation.as_str().into());
        let confirm = self
            .channel
            .basic_publish(
                self.exchange.as_str().into(),
                self.topic.as_str().into(), // routing key = topic
                BasicPublishOptions::default(),
                body.as_bytes(),
                properties,
            )
            .await?
            .await?; // the broker's confirm: it has the command
        if !confirm.is_ack() {
            return Err(format!("{op} {id}: the broker refused the command").into());
        }
        // The bridge's reply: Redis has applied the command.
        let reply = tokio::time::timeout(Duration::from_secs(10), self.replies.next())
            .await
            .map_err(|_| format!("{op} {id}: no reply in 10 s; is `redisched run` up?"))?
            .ok_or("the reply consumer ended")??;
        let answered = reply
            .properties
            .correlation_id()
            .clone()
            .map(|c| c.to_string());
        if answered != Some(correlation) {
            return Err(format!("{op} {id}: a reply to another command").into());
        }
        let answer: serde_json::Value = serde_json::from_slice(&reply.data)?;
        println!("{op} {id}: {answer}");
        if answer["status"] == "invalid" {
            return Err(format!("{op} {id}: invalid: {}", answer["error"]).into());
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let queue = channel
        .queue_declare("".into(), exclusive, FieldTable::default())
        .await?;
    let no_ack = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let replies = channel
        .basic_consume(
            queue.name().clone(),
            "".into(),
            no_ack,
            FieldTable::default(),
        )
        .await?;
    let mut producer = Producer {
        channel,
        exchange: env("COMMANDS_EXCHANGE", "redisched.commands"),
        topic: env("TOPIC", "emails"),
        replies,
        reply_queue: queue.name().to_string(),
    };

    #[rustfmt::skip]
    let commands = [
        ("put", "need_some_help_email_42", "Hi 42, need some help?", Some(3_000)),
        ("replace", "need_some_help_email_42", "Hi 42, need some help? Just reply.", Some(3_000)),
        ("delete", "need_some_help_email_42", "", None), // user 42 found their way: cancel
        ("put", "need_some_help_email_43", "Hi 43, need some help?", Some(3_000)),
    ];
    for (op, id, body, delay_ms) in commands {
        producer.command(op, id, body, delay_ms).await?;
    }
    connection.close(200, "bye".into()).await?;
    Ok(())
}

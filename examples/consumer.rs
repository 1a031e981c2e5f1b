//! Prints jobs as they come due on `redisched.ready`. `cargo run --example consumer` (with
//! `redisched run`). Delivery is at-least-once: dedupe on message_id if a duplicate would hurt.
//! Settings: AMQP_URL, READY_EXCHANGE (redisched.ready), QUEUE (emails), TOPIC (emails).

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let (exchange, queue, topic) = (
        env("READY_EXCHANGE", "redisched.ready"),
        env("QUEUE", "emails"),
        env("TOPIC", "emails"),
    );
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    // Durable: jobs that come due while the consumer is away wait in the queue.
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.as_str().into(), durable, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            topic.as_str().into(), // routing key = topic
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut jobs = channel
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    println!("waiting for jobs on queue {queue}");
    while let Some(job) = jobs.next().await {
        let job = job?;
        let headers = job.properties.headers().clone().unwrap_or_default();
        let due = match headers.inner().get("x-redisched-due-at") {
            Some(AMQPValue::LongLongInt(ms)) => ms.to_string(),
            other => format!("{other:?}"),
        };
        let id = job
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
            .unwrap_or_default();
        println!(
            "job {id} due at {due}: {}",
            String::from_utf8_lossy(&job.data)
        );
        job.ack(BasicAckOptions::default()).await?; // after the work is done
    }
    Ok(())
}

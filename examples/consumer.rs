//! Prints jobs as they come due. `cargo run --example consumer` (with `redisched run`).
//! Delivery is at-least-once: dedupe on message_id if a duplicate would hurt.

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare("emails".into(), durable, FieldTable::default())
        .await?;
    channel
        .queue_bind(
            "emails".into(),
            "redisched.ready".into(),
            "emails".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut jobs = channel
        .basic_consume(
            "emails".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    while let Some(job) = jobs.next().await {
        let job = job?;
        let headers = job.properties.headers().clone().unwrap_or_default();
        println!(
            "{:?} due at {:?} (attempt {:?}): {}",
            job.properties.message_id(),
            headers.inner().get("x-redisched-due-at"),
            headers.inner().get("x-redisched-attempt"),
            String::from_utf8_lossy(&job.data)
        );
        job.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}

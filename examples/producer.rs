//! Schedules a job 5 s out, another one to cancel, then cancels it — the wire contract
//! in a few lines. Run `redisched run` first, then `cargo run --example producer`.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    let command = |id: &str, op: &str, delay_ms: i64| {
        let mut headers = FieldTable::default();
        headers.insert(
            "x-redisched-op".into(),
            AMQPValue::LongString(LongString::from(op)),
        );
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay_ms));
        BasicProperties::default()
            .with_message_id(id.into())
            .with_content_type("text/plain".into())
            .with_headers(headers)
    };
    for (id, op, delay, body) in [
        ("need_some_help_email_42", "put", 5_000, "Need some help?"),
        ("need_some_help_email_43", "put", 5_000, "Need some help?"),
        ("need_some_help_email_43", "delete", 0, ""), // user 43 acted first
    ] {
        let confirm = channel
            .basic_publish(
                "redisched.commands".into(),
                "emails".into(), // routing key = topic
                BasicPublishOptions::default(),
                body.as_bytes(),
                command(id, op, delay),
            )
            .await?
            .await?;
        println!(
            "{op} {id}: broker {}",
            if confirm.is_ack() {
                "confirmed"
            } else {
                "refused"
            }
        );
    }
    connection.close(200, "bye".into()).await?;
    Ok(())
}

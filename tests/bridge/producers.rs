//! Producers redisched's authors did not write: a shell script with `amqp-publish`
//! (Debian `amqp-tools`, which cannot set `message_id`), and a consumer written for
//! RabbitMQ's delayed-message plugin (it reads `x-delay` on the delivered message).

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::bridge::*;
use lapin::types::AMQPValue;

const SECOND: Duration = Duration::from_secs(1);

/// `amqp-publish` with the config's commands exchange; headers as `"key: value"`.
fn amqp_publish(exchange: &str, topic: &str, headers: &[&str], body: &str) {
    let mut cmd = Command::new("amqp-publish");
    cmd.args([
        "--url",
        &common::amqp_url(),
        "-e",
        exchange,
        "-r",
        topic,
        "-p",
        "-b",
        body,
    ]);
    for header in headers {
        cmd.args(["-H", header]);
    }
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("amqp-publish cannot run ({e}): run `bash scripts/producer-deps.sh` (Debian amqp-tools)")
    });
    assert!(
        out.status.success(),
        "amqp-publish failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn header<'a>(delivery: &'a lapin::message::Delivery, name: &str) -> Option<&'a AMQPValue> {
    delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get(name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shell_script_schedules_and_cancels_with_amqp_publish() {
    let _shared = common::timed::shared().await;
    let config = test_config("shell");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let mut invalid = broker.consume_invalid().await;
    let bridge = InProcess::start(&config);
    let exchange = config.amqp.commands_exchange.as_str();

    let sent = now_ms();
    amqp_publish(
        exchange,
        "cron",
        &["x-redisched-id: nightly-report", "x-delay: 600"],
        "report",
    );
    amqp_publish(
        exchange,
        "cron",
        &["x-redisched-id: cancelled", "x-delay: 1500"],
        "never",
    );
    amqp_publish(
        exchange,
        "cron",
        &["x-redisched-id: cancelled", "x-redisched-op: delete"],
        "",
    );

    let (arrived, job) = ready
        .next(10 * SECOND)
        .await
        .expect("the job scheduled from the shell");
    assert_eq!(
        message_id(&job),
        "nightly-report",
        "x-redisched-id became message_id"
    );
    assert_eq!(job.data, b"report");
    assert!(
        arrived >= sent + 600,
        "not early: {} ms after publish",
        arrived - sent
    );
    assert!(
        header(&job, "x-redisched-id").is_none(),
        "control headers are not forwarded"
    );
    assert!(
        ready.drain(2 * SECOND).await.is_empty(),
        "the cancelled job never arrives"
    );
    assert!(invalid.drain(Duration::from_millis(200)).await.is_empty());

    // Both ids given and different: set aside with a reason, nothing scheduled.
    let mut props = props("one", &[("x-redisched-id", text("two"))]);
    props = props.with_delivery_mode(2);
    broker.command("cron", props, b"x").await;
    let (_, set_aside) = invalid.next(10 * SECOND).await.expect("set aside");
    let reason = match header(&set_aside, "x-redisched-error") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("no reason: {other:?}"),
    };
    assert!(reason.contains("differ"), "{reason}");
    assert!(ready.drain(SECOND).await.is_empty());

    bridge.stop().await;
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_jobs_carry_x_delay_as_the_delayed_message_plugin_does() {
    let _shared = common::timed::shared().await;
    let config = test_config("plugin");
    let broker = Broker::new(&config).await;
    let mut ready = broker.consume_ready("#").await;
    let bridge = InProcess::start(&config);

    broker
        .put("t", "delayed", b"", &[("x-delay", AMQPValue::LongInt(300))])
        .await;
    broker
        .put("t", "as-text", b"", &[("x-delay", text("200"))])
        .await;
    broker.put("t", "immediate", b"", &[]).await;
    let got = ready.collect(3, 10 * SECOND).await;
    assert_eq!(got.len(), 3);
    for (_, job) in &got {
        let delay = header(job, "x-delay");
        match message_id(job).as_str() {
            "delayed" => assert_eq!(delay, Some(&AMQPValue::LongInt(-300))),
            "as-text" => assert_eq!(delay, Some(&AMQPValue::LongInt(-200))),
            "immediate" => assert_eq!(delay, None, "no x-delay asked, none delivered"),
            other => panic!("unexpected {other}"),
        }
    }
    bridge.stop().await;
    broker.cleanup().await;
}

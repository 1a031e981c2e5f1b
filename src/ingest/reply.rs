//! Answering an applied batch, in batch order: for each command metrics, the live feed
//! and the reply on `reply_to` when the producer asked; invalid commands set aside
//! (publisher-confirmed) to the invalid exchange with their reason; then the batch acked
//! with one cumulative ack. All from what the delivery names ([`Envelope`]) and what
//! applying it found; only a set-aside republishes the delivery's properties, as they
//! came.

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, Channel, PublisherConfirm};
use serde_json::json;

use super::batch::AppliedBatch;
use super::decode::{Envelope, Received};
use super::Ingest;
use crate::amqp::AmqpError;
use crate::feed::Event;
use crate::job::headers;
use crate::store::{Applied, Op, PutStatus};
use crate::telemetry;

/// How one delivery ended, before it is acked (the history's outcome is
/// `store::Outcome`).
enum Verdict {
    Applied(Applied),
    /// A `delete-prefix` removed this many jobs.
    PrefixDeleted(u64),
    Invalid(String),
}

impl Ingest {
    /// Reports an applied batch (metrics, feed, replies), sets its invalid commands
    /// aside, confirmed, then acks it and every batch before it (one cumulative ack).
    /// Called in batch order.
    pub(super) async fn answer(
        &self,
        side: &Channel,
        applied: AppliedBatch,
    ) -> Result<(), AmqpError> {
        let AppliedBatch {
            batch,
            commands,
            ops,
            mut results,
            prefix,
        } = applied;
        let mut ops = ops.into_iter();
        results.reverse();
        let verdicts: Vec<Verdict> = match prefix {
            // A delete-prefix batch holds that one delivery.
            Some(Ok(deleted)) => vec![Verdict::PrefixDeleted(deleted)],
            Some(Err(invalid)) => vec![Verdict::Invalid(invalid.0)],
            None => commands
                .into_iter()
                .map(|command| match command {
                    Err(invalid) => Verdict::Invalid(invalid.0),
                    Ok(()) => match (ops.next(), results.pop()) {
                        (Some(command), Some(Ok(done))) => {
                            self.after_applied(&command.op, done);
                            Verdict::Applied(done)
                        }
                        (_, Some(Err(rejection))) => Verdict::Invalid(rejection.to_string()),
                        _ => Verdict::Invalid("internal: no result for this command".into()),
                    },
                })
                .collect(),
        };
        let mut set_aside: Vec<PublisherConfirm> = Vec::new();
        for (received, verdict) in batch.iter().zip(verdicts) {
            let Received {
                delivery,
                envelope,
                span,
            } = received;
            let failure = match &verdict {
                Verdict::Invalid(reason) => Some(reason.as_str()),
                _ => None,
            };
            telemetry::record_outcome(span, verdict_name(&verdict), failure);
            self.record(envelope, &verdict);
            self.reply(side, envelope, &verdict).await;
            if let Verdict::Invalid(reason) = &verdict {
                if self
                    .warnings
                    .admit(&envelope.topic, "invalid commands set aside", reason)
                {
                    tracing::warn!(topic = %envelope.topic, id = ?envelope.id, %reason, "invalid command set aside");
                }
                set_aside.push(self.set_aside(side, delivery, reason).await?);
            }
        }
        for confirm in set_aside {
            match confirm.await? {
                lapin::Confirmation::Ack(None) => {}
                _ => {
                    return Err(AmqpError::NotConfirmed {
                        exchange: self.config.amqp.invalid_exchange.clone(),
                    })
                }
            }
        }
        if let Some(last) = batch.last() {
            last.delivery
                .acker
                .ack(BasicAckOptions { multiple: true })
                .await?;
        }
        Ok(())
    }

    fn after_applied(&self, op: &Op, applied: Applied) {
        if let (Op::Put(put), Applied::Put(outcome)) = (op, applied) {
            if outcome.status != PutStatus::Duplicate {
                self.hints.hint(&put.topic, outcome.due_at);
            }
        }
    }

    fn record(&self, envelope: &Envelope, verdict: &Verdict) {
        let op = envelope.op_name;
        let outcome_name = verdict_name(verdict);
        self.metrics.command(op, outcome_name);
        if matches!(verdict, Verdict::Invalid(_)) {
            self.metrics.invalid_commands.inc();
        }
        self.feed.send_with(|| Event::Command {
            topic: envelope.topic.clone(),
            id: envelope.id.clone().unwrap_or_default(),
            op: op.into(),
            outcome: outcome_name.into(),
        });
    }

    /// Answers on `reply_to` when the producer asked. Best effort: a lost reply does not
    /// undo the command, so it is not awaited.
    async fn reply(&self, side: &Channel, envelope: &Envelope, verdict: &Verdict) {
        let Some(reply_to) = &envelope.reply else {
            return;
        };
        let mut body = json!({
            "status": verdict_name(verdict),
            "topic": envelope.topic,
            "id": envelope.id,
        });
        match verdict {
            Verdict::Applied(Applied::Put(put)) => body["due_at"] = json!(put.due_at),
            Verdict::Invalid(reason) => body["error"] = json!(reason),
            Verdict::PrefixDeleted(n) => body["deleted"] = json!(n),
            Verdict::Applied(Applied::Delete { .. }) => {}
        }
        let mut props = BasicProperties::default().with_content_type("application/json".into());
        if let Some(correlation) = &reply_to.correlation_id {
            props = props.with_correlation_id(correlation.clone());
        }
        let published = side
            .basic_publish(
                "".into(),
                reply_to.queue.clone(),
                BasicPublishOptions::default(),
                body.to_string().as_bytes(),
                props,
            )
            .await;
        if let Err(err) = published {
            tracing::warn!(error = %err, reply_to = %reply_to.queue, "could not send reply");
        }
    }

    /// Republishes a command, body and properties intact, to the invalid exchange with
    /// its reason. Mandatory: if the invalid queue is gone the publish is returned, the
    /// command is not acked, and the session restarts and re-declares the queue.
    async fn set_aside(
        &self,
        side: &Channel,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<PublisherConfirm, AmqpError> {
        let mut table = delivery.properties.headers().clone().unwrap_or_default();
        table.insert(
            headers::ERROR.into(),
            AMQPValue::LongString(LongString::from(reason.as_bytes().to_vec())),
        );
        let props = delivery.properties.clone().with_headers(table);
        Ok(side
            .basic_publish(
                self.config.amqp.invalid_exchange.as_str().into(),
                delivery.routing_key.clone(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                props,
            )
            .await?)
    }
}

/// The outcome label of metrics, the feed and the reply's `status`.
fn verdict_name(verdict: &Verdict) -> &'static str {
    match verdict {
        Verdict::Applied(Applied::Put(put)) => put.status.as_str(),
        Verdict::Applied(Applied::Delete { removed: true }) => "deleted",
        Verdict::Applied(Applied::Delete { removed: false }) => "not_found",
        Verdict::PrefixDeleted(0) => "not_found",
        Verdict::PrefixDeleted(_) => "deleted",
        Verdict::Invalid(_) => "invalid",
    }
}

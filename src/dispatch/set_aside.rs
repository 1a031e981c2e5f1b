//! Expired jobs set aside, whatever their sink. Right after a reserve, `reserve.rs`
//! judges each job by the rule of `src/job/expiry.rs`: one whose due time +
//! expires-after (its own `x-redisched-expires-after`, else its topic's `[[policies]]`
//! default; 0 = never) lies before the server's clock never reaches its sink, and comes
//! here instead (only expired jobs enter this file): it is published to the expired
//! exchange (body and properties as a delivery would carry them, plus
//! `x-redisched-error`), and released only once the broker confirmed that copy without
//! returning it, logged `expired`. Nothing vanishes: until then it stays reserved, and a
//! failed copy hands it back.
//!
//! The set-aside publishes on a confirm channel of its own, opened on the dispatch
//! stage's AMQP connection for as long as that session lives (`Dispatcher::run_session`),
//! with a confirmer of its own (the AMQP sink's `amqp/confirm.rs`: it pairs the channel's
//! returns with their jobs) and at most `dispatch.window` copies awaiting their
//! confirm. It borrows no sink's channel, and no sink waits for it: while no channel
//! is open (the broker is away) or the window is full, an expired job is handed back
//! with backoff and expires again at its next reservation.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lapin::protocol::basic::AMQPProperties;
use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::mpsc::{self, UnboundedSender};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::task::AbortOnDropHandle;
use tracing::Span;

use super::amqp::confirm::{Confirmer, InFlight};
use super::amqp::publish::{outgoing_properties, publish};
use super::reserve::Reserved;
use super::settle::Settler;
use crate::config::Config;
use crate::job::headers;
use crate::job::Topic;
use crate::log_throttle::LogThrottle;
use crate::policy::Policies;
use crate::store::ReservedJob;

/// Sets expired jobs aside; shared by every sink's loop.
#[derive(Debug)]
pub struct SetAside {
    /// The `[[policies]]`, whose `expires_after_ms` defaults the reserve judges expiry by.
    pub(super) policies: Policies,
    exchange: String,
    window: usize,
    /// Its confirm channel and confirmer while a dispatch session is open.
    publisher: Mutex<Option<Publisher>>,
}

#[derive(Debug, Clone)]
struct Publisher {
    channel: Channel,
    confirms: UnboundedSender<InFlight>,
    window: Arc<Semaphore>,
}

/// The set-aside's channel of one dispatch session; closed (or dropped) with it.
#[derive(Debug)]
pub(crate) struct Opened {
    set_aside: Arc<SetAside>,
    channel: Channel,
    confirmer: AbortOnDropHandle<()>,
}

impl SetAside {
    /// With the configuration's `[[policies]]` (their `expires_after_ms` defaults),
    /// expired exchange and confirm window.
    pub fn new(config: &Config) -> Self {
        Self {
            // `validate()` compiled the policies at load: this cannot fail here.
            policies: config.compiled_policies().unwrap_or_default(),
            exchange: config.amqp.expired_exchange.clone(),
            window: config.dispatch.window,
            publisher: Mutex::new(None),
        }
    }

    /// Opens the set-aside's confirm channel on `connection`, with its own confirmer
    /// (settling through `settler`); expired jobs are set aside on it until the
    /// returned [`Opened`] is closed or dropped.
    pub(crate) async fn open(
        self: &Arc<Self>,
        connection: &Connection,
        settler: Settler,
        warnings: Arc<LogThrottle>,
    ) -> Result<Opened, lapin::Error> {
        let channel = crate::amqp::confirm_channel(connection).await?;
        let (confirms, confirmed) = mpsc::unbounded_channel();
        let confirmer = Confirmer { settler, warnings };
        let confirmer = AbortOnDropHandle::new(tokio::spawn(confirmer.run(confirmed)));
        *self.lock() = Some(Publisher {
            channel: channel.clone(),
            confirms,
            window: Arc::new(Semaphore::new(self.window)),
        });
        Ok(Opened {
            set_aside: self.clone(),
            channel,
            confirmer,
        })
    }

    /// Sets aside a job that expired `ms` after its due time, in a task of its own (the
    /// loop goes on); hands it back with backoff when there is no channel or no room.
    pub(crate) fn take(&self, mut reserved: Reserved, ms: u64, settler: &Arc<Settler>) {
        let stored = reserved.take_properties();
        let Reserved { job, ticket, .. } = reserved;
        let ticket = ticket.expired_after(ms);
        let topic = ticket.lease.topic.clone();
        let copy = expired_properties(&topic, &job, stored, ticket.due_at, ms);
        let publisher = self.publisher();
        let (exchange, settler) = (self.exchange.clone(), settler.clone());
        tokio::spawn(async move {
            let (publisher, permit) = match publisher {
                Ok(publisher) => publisher,
                Err(why) => {
                    tracing::debug!(%topic, id = %job.id, "expired job: {why}; handed back");
                    let backoff = settler.retry_delay(job.attempt);
                    settler.defer(&ticket.lease, backoff).await;
                    return;
                }
            };
            let due_at = ticket.due_at;
            match publish(&publisher.channel, &exchange, &topic, &job, due_at, copy).await {
                Ok((key, confirm)) => {
                    let flight = InFlight {
                        ticket,
                        key,
                        confirm,
                        permit,
                        span: Span::none(),
                    };
                    if !flight.hand_to(&publisher.confirms, &settler.metrics) {
                        tracing::warn!(%topic, id = %job.id, "the set-aside's confirmer has stopped; the expired job waits for its requeue");
                    }
                }
                Err(err) => {
                    tracing::warn!(%topic, id = %job.id, %err, "could not set an expired job aside; handed back");
                    let backoff = settler.retry_delay(job.attempt);
                    settler.defer(&ticket.lease, backoff).await;
                }
            }
        });
    }

    /// The open channel and a permit of its window, or why not.
    fn publisher(&self) -> Result<(Publisher, OwnedSemaphorePermit), &'static str> {
        let publisher = self
            .lock()
            .clone()
            .filter(|p| p.channel.status().connected())
            .ok_or("no broker channel to set it aside on")?;
        let permit = publisher.window.clone().try_acquire_owned().map_err(|_| {
            "the set-aside's window is full (dispatch.window copies await their confirm)"
        })?;
        Ok((publisher, permit))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Publisher>> {
        self.publisher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Opened {
    /// Stops setting jobs aside on this channel, waits up to `grace` for the copies in
    /// flight to be confirmed (and settled), then closes the channel.
    pub(crate) async fn close(mut self, grace: std::time::Duration) {
        self.set_aside.lock().take();
        // The confirmer ends once every sender is gone and each copy is settled.
        if tokio::time::timeout(grace, &mut self.confirmer)
            .await
            .is_err()
        {
            self.confirmer.abort();
            tracing::warn!(
                ?grace,
                "confirms still pending at the end of the grace period; those jobs stay reserved and are requeued after their time-to-run"
            );
        }
        let closing = self.channel.close(200, "shutdown".into());
        crate::amqp::close_quietly("set-aside channel", closing).await;
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        self.set_aside.lock().take();
    }
}

/// What the expired exchange gets: the properties a delivery would carry, plus
/// `x-redisched-error` with the reason.
fn expired_properties(
    topic: &Topic,
    job: &ReservedJob,
    stored: AMQPProperties,
    due_at: i64,
    ms: u64,
) -> BasicProperties {
    // Not a delivery: no span of its own, the stored context as it is.
    let props = outgoing_properties(topic.as_str(), job, stored, due_at, &Span::none());
    let mut table = props.headers().clone().unwrap_or_default();
    table.insert(
        headers::ERROR.into(),
        AMQPValue::LongString(LongString::from(
            crate::job::expiry::reason(ms).into_bytes(),
        )),
    );
    props.with_headers(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_channel_nothing_is_set_aside() {
        let set_aside = SetAside::new(&Config::default());
        assert_eq!(
            set_aside.publisher().map(|_| ()),
            Err("no broker channel to set it aside on")
        );
    }
}

//! The sink seam. A sink delivers the jobs of the topics routed to it; dispatch runs one
//! loop per sink (`Dispatcher::run` in `mod.rs`) that keeps the sink's topics planned,
//! naps until one is due and then asks the sink for a [`Sink::round`]: the sink
//! reserves through [`Core::reserve`] no more jobs than it can send now (prepare),
//! sends them (call), and reports each outcome to the [`Settler`] (handle): release
//! after a broker ack without return / after a 2xx, hand back with backoff otherwise.
//! Expired jobs and series that cannot go on never reach a sink: the reserve sets them
//! aside or fails them first.
//!
//! Which sink a topic goes to is decided here, once ([`Routes`]): the first sink beside
//! AMQP that serves it, else the AMQP sink (the ready exchange); the list of sinks beside
//! AMQP is built by `routes` in `mod.rs`. The AMQP sink runs per
//! AMQP session (`amqp/`); the others for the whole process, each with a loop, a plan
//! and a copy of the hints of its own, so a broker outage does not stop them.
//!
//! [`Core::reserve`]: super::Core::reserve
//! [`Settler`]: super::Settler

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use super::Core;
use crate::amqp::AmqpError;
use crate::job::Topic;
use crate::store::StoreError;

/// A way out for due jobs.
pub trait Sink: Send + Sync + std::fmt::Debug {
    /// What the logs call this sink's loop (`redis unavailable; <name> waits`).
    fn name(&self) -> &str;

    /// Whether this sink delivers `topic`'s jobs. Asked only of the sinks beside AMQP,
    /// in [`Routes`] order; the AMQP sink takes every topic none of them serves.
    fn serves(&self, topic: &Topic) -> bool;

    /// One round over `due` (this sink's due topics, a different one first each round):
    /// reserve through `core` no more jobs than can be sent now, so that no job waits
    /// reserved in the bridge towards its time-to-run, and start sending them; each
    /// outcome goes to `core.settler()`. [`Round::Idle`] when nothing could be taken.
    fn round<'a>(
        &'a self,
        due: Vec<Topic>,
        core: &'a mut Core<'_>,
    ) -> BoxFuture<'a, Result<Round, RoundError>>;

    /// Resolves when a delivery ended and freed room: the nap of a round that left
    /// topics out for want of room ends then.
    fn room_freed(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::pending())
    }

    /// When room too small to be worth a reserve yet is served anyway: such a nap
    /// ends then at the latest.
    fn lingering_until(&self) -> Option<Instant> {
        None
    }

    /// On shutdown: waits up to `grace` for deliveries in flight (and logs those left
    /// to their time-to-run).
    fn drain(&self, _grace: Duration) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// What a round came to.
#[derive(Debug)]
pub enum Round {
    /// Jobs were taken (or the sink waited): plan again at once.
    Served,
    /// Nothing taken; these due topics wait for room ([`Sink::room_freed`]).
    Idle(HashSet<Topic>),
}

/// Why a round stopped short.
#[derive(Debug, thiserror::Error)]
pub enum RoundError {
    /// Redis did not answer: the loop waits with backoff and goes on.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The AMQP session's channel failed: its loop ends and the session is reopened
    /// (a sink beside AMQP that says this only waits, like for Redis).
    #[error(transparent)]
    Broker(#[from] AmqpError),
}

/// Where each topic's jobs go.
#[derive(Debug, Default)]
pub struct Routes {
    sinks: Vec<Arc<dyn Sink>>,
}

/// A topic's sink: the AMQP one, or the sink beside it at this index of [`Routes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Amqp,
    Sink(usize),
}

impl Routes {
    /// The sinks beside AMQP, in the order they are asked whether they serve a topic.
    pub fn new(sinks: Vec<Arc<dyn Sink>>) -> Self {
        Self { sinks }
    }

    pub fn route(&self, topic: &Topic) -> Route {
        self.sinks
            .iter()
            .position(|sink| sink.serves(topic))
            .map_or(Route::Amqp, Route::Sink)
    }

    pub fn sinks(&self) -> &[Arc<dyn Sink>] {
        &self.sinks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Prefix(&'static str);

    impl Sink for Prefix {
        fn name(&self) -> &str {
            self.0
        }
        fn serves(&self, topic: &Topic) -> bool {
            topic.as_str().starts_with(self.0)
        }
        fn round<'a>(
            &'a self,
            _: Vec<Topic>,
            _: &'a mut Core<'_>,
        ) -> BoxFuture<'a, Result<Round, RoundError>> {
            Box::pin(async { Ok(Round::Idle(HashSet::new())) })
        }
    }

    #[test]
    fn the_first_sink_that_serves_a_topic_takes_it_and_amqp_the_rest() {
        let routes = Routes::new(vec![Arc::new(Prefix("hook")), Arc::new(Prefix("h"))]);
        let t = |name: &str| Topic::new(name).unwrap();
        assert_eq!(routes.route(&t("hook.a")), Route::Sink(0));
        assert_eq!(routes.route(&t("h.a")), Route::Sink(1));
        assert_eq!(routes.route(&t("mail")), Route::Amqp);
        assert_eq!(Routes::default().route(&t("hook.a")), Route::Amqp);
    }
}

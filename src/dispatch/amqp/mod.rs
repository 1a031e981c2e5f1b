//! The AMQP sink: jobs of every topic no other sink serves go to the ready exchange,
//! published with `mandatory` in confirm mode, and are released only once the broker
//! acked them without returning them. One sink per AMQP session of the dispatch stage
//! (`Dispatcher::run_session`); a broker outage or block stops it, not the other sinks.
//!
//! By role: `sink.rs` the round (confirm window, reserve, publish in turn on the
//! lanes: the session's confirm channels and their confirmers, and the broker's block);
//! `publish.rs` one publish, the properties it carries and the key (`ReturnKey`) its
//! return would be matched by; `confirm.rs` the confirmer, which settles each publish
//! (the set-aside of expired jobs uses `publish.rs` and `confirm.rs` on its own
//! channel).

pub(crate) mod confirm;
pub(crate) mod publish;
mod sink;

pub(crate) use sink::AmqpSink;

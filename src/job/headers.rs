//! Header names of the wire contract. Producers and consumers code against these.

/// Delay in ms (integer or numeric string), as with RabbitMQ's delayed-message plugin.
pub const DELAY: &str = "x-delay";
/// Absolute due time, epoch ms.
pub const DELIVER_AT: &str = "x-deliver-at";
/// `put` (default), `replace` or `delete`.
pub const OP: &str = "x-redisched-op";
/// The job id, for producers that cannot set `message_id` (`amqp-publish`); used
/// when `message_id` is absent, and must equal it when both are set.
pub const ID: &str = "x-redisched-id";
/// Why a command was set aside to the invalid exchange.
pub const ERROR: &str = "x-redisched-error";
/// On delivered jobs: the topic, the due time (epoch ms) and the attempt (1 first).
pub const TOPIC: &str = "x-redisched-topic";
pub const DUE_AT: &str = "x-redisched-due-at";
pub const ATTEMPT: &str = "x-redisched-attempt";
/// On delivered jobs: the occurrence's scheduled time before its jitter (epoch ms;
/// equal to the due time when there is none).
pub const SCHEDULED_AT: &str = "x-redisched-scheduled-at";
/// A recurring job: its interval in ms (integer, or a numeric string).
pub const EVERY: &str = "x-redisched-every";
/// A recurring job: a cron expression (5 fields, or 6 with leading seconds) ...
pub const CRON: &str = "x-redisched-cron";
/// ... evaluated in this IANA time zone (default `UTC`).
pub const TZ: &str = "x-redisched-tz";
/// A recurring job: delay each occurrence by a deterministic amount in `[0, ms)`
/// (integer, or a numeric string). Stored with the job (its meta), like the
/// schedule headers: dispatch reads it there.
pub const JITTER: &str = "x-redisched-jitter";
/// A job of a webhook target's topic: the URL to POST it to instead of the
/// target's, allowed only under the target's `allowed_url_prefixes`. Stored with the
/// job (its meta) like any other header.
pub const URL: &str = "x-redisched-url";
/// A job expires this many ms after its due time if not delivered by then: it is
/// set aside to the expired exchange instead (0 = never). Stored with the job.
pub const EXPIRES_AFTER: &str = "x-redisched-expires-after";
/// W3C Trace Context: the sender's trace, stored with the job and delivered unchanged
/// (from an AMQP command's headers, or a REST put's request headers: `trace.rs`).
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";
/// Control headers: consumed by the bridge, never stored or forwarded.
pub const CONTROL: [&str; 4] = [DELAY, DELIVER_AT, OP, ID];
/// Headers the bridge writes on what it publishes. On a command they are ignored and
/// dropped (never stored or forwarded), so a set-aside command can be re-published
/// once fixed, and a delivered job re-published as a command, without being refused.
pub const OUTPUT: [&str; 5] = [ERROR, TOPIC, DUE_AT, ATTEMPT, SCHEDULED_AT];
/// Every `x-redisched-*` header a command may carry; any other is refused, so a
/// producer never silently gets other semantics than it asked for.
pub const KNOWN: [&str; 13] = [
    OP,
    ID,
    EVERY,
    CRON,
    TZ,
    JITTER,
    ERROR,
    TOPIC,
    DUE_AT,
    ATTEMPT,
    SCHEDULED_AT,
    URL,
    EXPIRES_AFTER,
];
/// The prefix of the bridge's own headers (compared ignoring ASCII case).
pub const PREFIX: &str = "x-redisched-";

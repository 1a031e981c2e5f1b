//! One webhook request, in a task of its own, read top to bottom as [`Delivery::run`]
//! goes: prepare, the request a job becomes (its headers: the target's own, forwarded
//! AMQP headers, the job's `x-redisched-*`, and the Standard Webhooks id, timestamp and
//! signature, made here; its body: raw, or the original servers' JSON); call, the POST
//! (`client.rs`); handle, its outcome told to the settle module and, in an [`Ended`]
//! message, to the target's gate (which takes it in at the next round or sync): a 2xx released in a batch with others ([`Releases`]), a refused job URL
//! parked, any other failure handed back after its backoff (or `Retry-After`, if later).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use hmac::{Hmac, Mac};
use hyper::body::Bytes;
use lapin::protocol::basic::AMQPProperties;
use lapin::types::AMQPValue;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tracing::Span;

use super::client::{judge, Client, Delivered, Failure, Outcome};
use crate::dispatch::reserve::{Reserved, Ticket};
use crate::dispatch::settle::Settler;
use crate::job::headers;
use crate::job::trace::TraceContext;
use crate::metrics::TargetMeter;
use crate::targets::{BodyMode, TargetConfig};
use crate::telemetry::{self, Via};

/// The request header carrying the job's own URL (`allowed_url_prefixes`): never
/// forwarded.
const URL_HEADER: &str = headers::URL;
/// The prefix of forwarded AMQP headers (`forward_headers = true`).
pub const FORWARDED_PREFIX: &str = "x-redisched-header-";

// The names every request carries, built at compile time rather than parsed per request.
const TOPIC: HeaderName = HeaderName::from_static(headers::TOPIC);
const ID: HeaderName = HeaderName::from_static(headers::ID);
const DUE_AT: HeaderName = HeaderName::from_static(headers::DUE_AT);
const ATTEMPT: HeaderName = HeaderName::from_static(headers::ATTEMPT);
const SCHEDULED_AT: HeaderName = HeaderName::from_static(headers::SCHEDULED_AT);
const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");
/// Headers a request adds to the target's own (forwarded ones aside, the trace context
/// counted): no regrowth.
const OWN_HEADERS: usize = 11;

/// A reserved job on its way to its target.
pub(super) struct Delivery {
    pub(super) client: Arc<Client>,
    pub(super) meter: Arc<TargetMeter>,
    pub(super) reserved: Reserved,
    pub(super) settler: Arc<Settler>,
    /// Signalled when the request ends and frees its slot.
    pub(super) room: Arc<Notify>,
    pub(super) releases: Arc<Releases>,
    /// What the request tells its target's gate when it ends.
    pub(super) report: Report,
}

/// What a request's end tells its target's gate (`gate.rs` takes it in): the outcome
/// for the breaker, the end of a retry for the lane.
#[derive(Debug)]
pub(super) struct Ended {
    /// The target's index in the sink.
    pub(super) index: usize,
    /// The half-open target's one probe request.
    pub(super) probe: bool,
    /// A retry, counted in flight by the lane.
    pub(super) retry: bool,
    /// What the target's own URL said (`None`: a job's own URL, or no request made).
    pub(super) outcome: Option<Outcome>,
}

impl Ended {
    /// Whether the breaker's sync should hear of it at once: a failure, a 410, a
    /// probe's answer (a success while closed waits for the next sync).
    fn urgent(&self) -> bool {
        match &self.outcome {
            None => false,
            Some(Outcome::Ok) => self.probe,
            Some(_) => true,
        }
    }
}

/// Sends its [`Ended`] once, when dropped: as the request's slot frees, or as its task
/// unwinds (a retry is never left counted in flight).
#[derive(Debug)]
pub(super) struct Report {
    ended: Option<Ended>,
    to: UnboundedSender<Ended>,
    /// The breaker's sync task, woken by an urgent outcome.
    wake: Arc<Notify>,
}

impl Report {
    pub(super) fn new(ended: Ended, to: UnboundedSender<Ended>, wake: Arc<Notify>) -> Self {
        Self {
            ended: Some(ended),
            to,
            wake,
        }
    }

    fn outcome(&mut self, outcome: Outcome) {
        if let Some(ended) = &mut self.ended {
            ended.outcome = Some(outcome);
        }
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        let Some(ended) = self.ended.take() else {
            return;
        };
        let urgent = ended.urgent();
        // Refused only once the gates are gone with the sink: no one left to tell.
        if self.to.send(ended).is_ok() && urgent {
            self.wake.notify_one();
        }
    }
}

impl Delivery {
    /// Runs the request, holding `slot` until its answer (a failure: until its retry is
    /// recorded); a delivered job's release follows, batched.
    pub(super) async fn run(self, slot: OwnedSemaphorePermit) {
        let Self {
            client,
            meter,
            mut reserved,
            settler,
            room,
            releases,
            mut report,
        } = self;
        let props = reserved.take_properties();
        let via = Via::Webhook {
            target: &client.target.name,
        };
        let span = telemetry::delivery_span(props.headers().as_ref(), &reserved.attempt_via(via));
        let trace = telemetry::outgoing(&span, TraceContext::of_props(&props));
        // Moved, not copied: the request shares these bytes.
        let body = Bytes::from(std::mem::take(&mut reserved.job.body));
        let Reserved { job, ticket, .. } = reserved;
        let outgoing = Outgoing {
            topic: ticket.lease.topic.as_str(),
            id: &job.id,
            due_at: ticket.due_at,
            scheduled_at: ticket.scheduled_at,
            attempt: job.attempt,
            body: &body,
            props: &props,
            trace: trace.as_ref(),
        };
        let (headers, request_body) = prepare(&client, &outgoing);
        meter.started();
        let (result, took, to_target) = client.post(&props, headers, request_body).await;
        // Only the target's own URL tells of its health.
        if to_target {
            report.outcome(judge(&result));
        }
        record_answer(&span, &result);
        drop(span);
        let seconds = took.as_secs_f64();
        let delivered = match result {
            Ok(delivered) => Some(answered(&meter, delivered, seconds, ticket)),
            Err(failure) => {
                meter.finished(
                    failure.code,
                    &status_of(&failure),
                    Some(failure.reason.clone()),
                    seconds,
                );
                tracing::debug!(target = %client.target.name, topic = %ticket.lease.topic, id = %job.id, reason = %failure.reason, "webhook delivery failed; retried");
                failed(&settler, &ticket, &failure).await;
                None
            }
        };
        // The request is over (a failure's retry recorded): its gate hears first, so
        // the round its slot wakes sees the outcome; the slot serves the next job,
        // while a delivered one waits for its release.
        drop(report);
        drop(slot);
        room.notify_one();
        if let Some(ticket) = delivered {
            releases.release(&settler, ticket).await;
        }
    }
}

// Prepare: the request a job becomes.

/// `job`'s request to `client`'s target: its headers, signed with the keys valid now,
/// and its body.
fn prepare(client: &Client, job: &Outgoing<'_>) -> (HeaderMap, Bytes) {
    let body = body(&client.target, job);
    let keys = client.signing_keys();
    let headers = headers(&client.target, client.extra(), &keys, job, &body);
    (headers, body)
}

/// One due job as the transport sees it.
#[derive(Debug)]
struct Outgoing<'a> {
    topic: &'a str,
    id: &'a str,
    /// When it was due (a series occurrence's jittered time).
    due_at: i64,
    /// The occurrence's scheduled time before its jitter (`due_at` when none).
    scheduled_at: i64,
    attempt: u32,
    /// Shared, not copied, into a raw request's body.
    body: &'a Bytes,
    /// The job's stored AMQP properties (content type, forwarded headers, its URL).
    props: &'a AMQPProperties,
    /// The trace context the request carries as `traceparent` / `tracestate`
    /// (`telemetry::outgoing`), whatever `forward_headers` says.
    trace: Option<&'a TraceContext>,
}

/// The request's headers: the target's own (`extra`), the forwarded ones, the trace
/// context, the job's (`x-redisched-*`) and the Standard Webhooks id, timestamp and signature of
/// `body` (one per key of `keys`). Each is inserted in that order, a later one
/// replacing an earlier of its name.
fn headers(
    target: &TargetConfig,
    extra: &HeaderMap,
    keys: &[&[u8]],
    job: &Outgoing<'_>,
    body: &[u8],
) -> HeaderMap {
    let mut map = if extra.is_empty() {
        HeaderMap::with_capacity(OWN_HEADERS)
    } else {
        let mut map = extra.clone();
        map.reserve(OWN_HEADERS);
        map
    };
    if target.forward_headers {
        forward(job.props, &mut map);
    }
    telemetry::inject_http(job.trace, &mut map);
    let content_type = match (target.body_mode(), job.props.content_type()) {
        (BodyMode::Seed, _) => Ok(HeaderValue::from_static("application/json")),
        (BodyMode::Raw, Some(ct)) => HeaderValue::from_str(ct.as_str()),
        (BodyMode::Raw, None) => Ok(HeaderValue::from_static("application/octet-stream")),
    };
    // As before: a value that cannot be a header value is left out, not an error.
    if let Ok(value) = content_type {
        map.insert(CONTENT_TYPE, value);
    }
    if let Ok(value) = HeaderValue::from_str(job.topic) {
        map.insert(TOPIC, value);
    }
    if let Ok(value) = header_safe_value(job.id) {
        map.insert(ID, value);
    }
    map.insert(DUE_AT, decimal(job.due_at));
    map.insert(ATTEMPT, decimal(job.attempt));
    map.insert(SCHEDULED_AT, decimal(job.scheduled_at));
    let msg_id = webhook_id(job.topic, job.id, job.due_at, job.body, job.props);
    let timestamp = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let signed = (!keys.is_empty()).then(|| signature(keys, &msg_id, timestamp, body));
    if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from(msg_id)) {
        map.insert(WEBHOOK_ID, value);
    }
    map.insert(WEBHOOK_TIMESTAMP, decimal(timestamp));
    if let Some(Ok(value)) = signed.map(|s| HeaderValue::from_maybe_shared(Bytes::from(s))) {
        map.insert(WEBHOOK_SIGNATURE, value);
    }
    map
}

// Standard Webhooks: the message id and the signature.

/// `webhook-signature`: `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, one per
/// key, space-separated (a consumer accepts any one: rotation).
fn signature(keys: &[&[u8]], msg_id: &str, timestamp: u64, body: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    keys.iter()
        .filter_map(|key| {
            let mut mac = Hmac::<Sha256>::new_from_slice(key).ok()?;
            mac.update(msg_id.as_bytes());
            mac.update(b".");
            mac.update(timestamp.to_string().as_bytes());
            mac.update(b".");
            mac.update(body);
            Some(format!("v1,{}", b64.encode(mac.finalize().into_bytes())))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `webhook-id`: a digest of what makes one occurrence: topic, id, due time, stored
/// properties and body. Every retry of an occurrence carries the same one; the next
/// occurrence of a series (another due time) and a replace that changes the job's
/// body, headers or due time get another. Derived, so no record format changes and
/// every bridge computes the same id.
fn webhook_id(topic: &str, id: &str, due_at: i64, body: &[u8], props: &AMQPProperties) -> String {
    let mut hash = Sha256::new();
    for part in [topic.as_bytes(), id.as_bytes()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hash.update(due_at.to_be_bytes());
    let meta = crate::job::meta::encode_meta(props);
    hash.update((meta.len() as u64).to_be_bytes());
    hash.update(&meta);
    hash.update(body);
    let digest = hash.finalize();
    format!(
        "msg_{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..18])
    )
}

/// The request's body: the job's own bytes (shared, not copied), or the original
/// servers' JSON (`body = "seed"`).
fn body(target: &TargetConfig, job: &Outgoing<'_>) -> Bytes {
    match target.body_mode() {
        BodyMode::Raw => job.body.clone(),
        BodyMode::Seed => Bytes::from(seed_body(job)),
    }
}

/// The original servers' body: `{"topic","id","contents"}`, contents as text (lossy
/// for bytes that are not UTF-8).
fn seed_body(job: &Outgoing<'_>) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "topic": job.topic,
        "id": job.id,
        "contents": String::from_utf8_lossy(job.body.as_ref()),
    }))
    .unwrap_or_default()
}

/// Forwarded AMQP headers as `x-redisched-header-<name>`: text and numbers as they
/// are; other types as JSON-ish text. The job's URL is not forwarded.
fn forward(props: &AMQPProperties, map: &mut HeaderMap) {
    let Some(table) = props.headers() else {
        return;
    };
    for (key, value) in table.inner() {
        if key.as_str() == URL_HEADER {
            continue;
        }
        let text = match value {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            AMQPValue::ShortString(s) => s.as_str().to_owned(),
            AMQPValue::Boolean(b) => b.to_string(),
            AMQPValue::ShortShortInt(n) => n.to_string(),
            AMQPValue::ShortShortUInt(n) => n.to_string(),
            AMQPValue::ShortInt(n) => n.to_string(),
            AMQPValue::ShortUInt(n) => n.to_string(),
            AMQPValue::LongInt(n) => n.to_string(),
            AMQPValue::LongUInt(n) => n.to_string(),
            AMQPValue::LongLongInt(n) => n.to_string(),
            AMQPValue::Float(n) => n.to_string(),
            AMQPValue::Double(n) => n.to_string(),
            AMQPValue::Timestamp(n) => n.to_string(),
            other => format!("{other:?}"),
        };
        let name = format!("{FORWARDED_PREFIX}{}", key.as_str().to_ascii_lowercase());
        put(map, &name, &header_safe(&text));
    }
}

/// [`header_safe`] as a header value, with no copy to a `String` for plain text.
fn header_safe_value(text: &str) -> Result<HeaderValue, reqwest::header::InvalidHeaderValue> {
    if is_plain(text) {
        HeaderValue::from_str(text)
    } else {
        HeaderValue::from_str(&header_safe(text))
    }
}

fn is_plain(text: &str) -> bool {
    text.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b'%')
}

/// Text as a header value: printable ASCII as is, anything else percent-encoded.
fn header_safe(text: &str) -> String {
    if is_plain(text) {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric()
            || b"-._~".contains(&b)
            || ((0x20..0x7f).contains(&b) && b != b'%')
        {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A number as `to_string` writes it, as a header value, formatted on the stack (`itoa`)
/// rather than through a growable buffer as `HeaderValue::from` for integers does.
fn decimal(n: impl itoa::Integer) -> HeaderValue {
    HeaderValue::from_str(itoa::Buffer::new().format(n))
        .unwrap_or_else(|_| HeaderValue::from_static("0"))
}

fn put(map: &mut HeaderMap, name: &str, value: &str) {
    if let (Ok(name), Ok(value)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        map.insert(name, value);
    }
}

// Handle: what came of the request.

/// A 2xx: counted, and the ticket noted `HTTP <status>` for its history entry.
fn answered(meter: &TargetMeter, delivered: Delivered, seconds: f64, ticket: Ticket) -> Ticket {
    let mut status = itoa::Buffer::new();
    meter.finished("2xx", status.format(delivered.status), None, seconds);
    Ticket {
        note: format!("HTTP {}", delivered.status),
        ..ticket
    }
}

/// How the attempt ended, on its delivery span (nothing to do unless exported).
fn record_answer(span: &Span, result: &Result<Delivered, Failure>) {
    if span.is_none() {
        return;
    }
    let (status, outcome, failure) = match result {
        Ok(delivered) => (Some(delivered.status), "delivered", None),
        Err(failure) if failure.is_refusal() => (failure.status, "parked", Some(failure)),
        Err(failure) => (failure.status, "retried", Some(failure)),
    };
    if let Some(status) = status {
        telemetry::record_http_status(span, status);
    }
    telemetry::record_outcome(span, outcome, failure.map(|f| f.reason.as_str()));
}

/// The failure's HTTP status, or its code when there was no answer.
fn status_of(failure: &Failure) -> String {
    failure
        .status
        .map_or_else(|| failure.code.to_owned(), |s| s.to_string())
}

/// A failed request: parked if no retry can mend it (its URL refused), else handed
/// back after its backoff; `Retry-After` says "not before", never earlier than that.
async fn failed(settler: &Settler, ticket: &Ticket, failure: &Failure) {
    if failure.is_refusal() {
        settler.park(&ticket.lease, &failure.reason).await;
        return;
    }
    let cap = Duration::from_millis(settler.config.dispatch.retry_max_ms);
    let delay = settler
        .retry_delay(ticket.attempt)
        .max(failure.retry_after.map_or(Duration::ZERO, |d| d.min(cap)));
    settler
        .fail(&ticket.lease, delay, "webhook", &failure.reason)
        .await;
}

/// Delivered jobs waiting for their release, and whether a request's task is releasing
/// now. Releases go to Redis in batches: the task that finds none running releases
/// everything that has gathered (its own job first), looping until nothing is left; a
/// request that ends meanwhile only adds its job. One `release.lua` round trip per job
/// made the store the bottleneck (the AMQP sink batches its confirms the same way). A
/// job gives its slot back when its answer comes, not when its release does: a slot
/// bounds requests in flight, and the release round trip no longer idles it (jobs
/// reserved at once: `max_in_flight` plus the delivered ones of the release running).
#[derive(Debug, Default)]
pub(super) struct Releases {
    pending: Mutex<(Vec<Ticket>, bool)>,
}

impl Releases {
    fn lock(&self) -> MutexGuard<'_, (Vec<Ticket>, bool)> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn release(&self, settler: &Settler, done: Ticket) {
        {
            let mut pending = self.lock();
            pending.0.push(done);
            if pending.1 {
                return;
            }
            pending.1 = true;
        }
        loop {
            let batch = {
                let mut pending = self.lock();
                if pending.0.is_empty() {
                    pending.1 = false;
                    return;
                }
                std::mem::take(&mut pending.0)
            };
            settler.release(&batch).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_are_not_plain_ascii_are_percent_encoded() {
        assert_eq!(header_safe("order-42"), "order-42");
        assert_eq!(header_safe("größe"), "gr%C3%B6%C3%9Fe");
        assert_eq!(header_safe("100%"), "100%25");
    }

    #[test]
    fn numbers_are_written_as_to_string_writes_them() {
        for n in [0, 7, -1, 1_796_090_000_002, i64::MAX, i64::MIN] {
            assert_eq!(decimal(n), n.to_string().as_str());
        }
        assert_eq!(decimal(u64::MAX), u64::MAX.to_string().as_str());
    }

    // Standard Webhooks.

    /// The Standard Webhooks specification's known-answer vector (its reference
    /// libraries' `test_sign_function`): secret `whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw`,
    /// id `msg_p5jXN8AQM9LWM0D4loKWxJek`, timestamp 1614265330, body
    /// `{"test": 2432232314}`.
    const VECTOR_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const VECTOR_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const VECTOR_TIMESTAMP: u64 = 1_614_265_330;
    const VECTOR_BODY: &[u8] = br#"{"test": 2432232314}"#;
    const VECTOR_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn the_standard_webhooks_known_answer_vector() {
        // The secret read as a target's configured secret is, `whsec_` and all.
        let key = crate::targets::secret_key(VECTOR_SECRET).expect("the spec's secret");
        let sig = signature(&[&key], VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY);
        assert_eq!(sig, VECTOR_SIGNATURE);
        // The spec's tests: one byte of the body, the id or the time changes it.
        for (id, timestamp, body) in [
            (
                "msg_p5jXN8AQM9LWM0D4loKWxJeK",
                VECTOR_TIMESTAMP,
                VECTOR_BODY,
            ),
            (VECTOR_ID, VECTOR_TIMESTAMP + 1, VECTOR_BODY),
            (VECTOR_ID, VECTOR_TIMESTAMP, &br#"{"test": 2432232315}"#[..]),
        ] {
            assert_ne!(signature(&[&key], id, timestamp, body), VECTOR_SIGNATURE);
        }
    }

    #[test]
    fn during_a_rotation_each_key_signs_and_the_vectors_signature_is_among_them() {
        let key = crate::targets::secret_key(VECTOR_SECRET).expect("the spec's secret");
        let other = crate::targets::secret_key("whsec_c2Vjb25kIHNlY3JldCBkdXJpbmcgcm90YXRpb24=")
            .expect("a second secret");
        let both = signature(&[&other, &key], VECTOR_ID, VECTOR_TIMESTAMP, VECTOR_BODY);
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts.len(), 2, "{both}");
        assert_eq!(parts[1], VECTOR_SIGNATURE, "in the order listed");
        assert_ne!(parts[0], VECTOR_SIGNATURE);
        assert!(parts[0].starts_with("v1,"));
    }

    #[test]
    fn the_id_changes_with_the_occurrence_and_not_with_the_attempt() {
        let props = AMQPProperties::default();
        let a = webhook_id("t", "j", 1000, b"x", &props);
        assert_eq!(a, webhook_id("t", "j", 1000, b"x", &props));
        assert_ne!(a, webhook_id("t", "j", 2000, b"x", &props));
        assert_ne!(a, webhook_id("t", "j", 1000, b"y", &props));
        assert_ne!(a, webhook_id("t", "j2", 1000, b"x", &props));
    }
}

//! The spans the stages and faces make, and the trace context they pass on. Each helper
//! is free when export is off: it answers `Span::none()` (or leaves headers as they are)
//! after one relaxed load, so a stage may call it on every job.
//!
//! - [`ingest_span`]: a command taken from the commands queue, a child of the producer's
//!   span (its `traceparent` header).
//! - [`delivery_span`]: one delivery attempt (AMQP publish until confirmed, or a webhook
//!   request), a child of the context stored with the job: the trace goes on across the
//!   delay, through every attempt and every occurrence of a series.
//! - [`http_command_span`]: a put over HTTP, a child of the request's `traceparent`.
//! - [`inject_amqp`], [`inject_http`], [`outgoing`]: the context a delivered job carries:
//!   the delivery span's when exported (the consumer continues from the attempt that
//!   brought it, in the same trace), else the stored one unchanged.
//!
//! Attributes follow OpenTelemetry's messaging conventions (`messaging.system`,
//! `messaging.destination.name`, `messaging.message.id`, `messaging.operation.type`) and
//! HTTP's; redisched's own are named `redisched.*`: `topic`, `id`, `attempt` (1 first),
//! `due_at`, `scheduled_at` (a series' occurrence before its jitter) and `reserved_at`
//! (epoch ms, Redis's clock), `due_ms` (how long the job had been due when this attempt
//! took it: a rate limit, a pause, a retry's back-off or a backlog), `paused_ms` (the
//! part of that wait during which its topic was paused: the overlap of `[due_at,
//! reserved_at]` with the topic's last pause, as dispatch saw it begin and end, by
//! [`paused_ms`]; 0 when none), `throttled` (the reserve call that took it held due jobs
//! back for the topic's rate limit) and `outcome`.

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

use lapin::types::FieldTable;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tracing::field::Empty;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::job::headers;
use crate::job::trace::TraceContext;

/// The `tracing` target of these spans: the one the OpenTelemetry layer listens to, and
/// the one the log leaves out.
pub const TARGET: &str = "redisched::otel";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (set once, by [`super::init`]).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

pub(super) fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// A command as ingest takes it from the broker.
#[derive(Debug, Clone, Copy)]
pub struct Ingest<'a> {
    /// The exchange it was published to (`amqp.commands_exchange`).
    pub exchange: &'a str,
    /// Its routing key: the topic.
    pub routing_key: &'a str,
    /// `message_id` or `x-redisched-id`, when it has one.
    pub message_id: Option<&'a str>,
}

/// Where a delivery attempt goes.
#[derive(Debug, Clone, Copy)]
pub enum Via<'a> {
    /// Published to the ready exchange, routing key = topic.
    Amqp { exchange: &'a str },
    /// POSTed by a webhook target (its name).
    Webhook { target: &'a str },
}

/// One delivery attempt, as a reserve reply tells dispatch about it.
#[derive(Debug, Clone, Copy)]
pub struct Delivery<'a> {
    pub via: Via<'a>,
    pub topic: &'a str,
    pub id: &'a str,
    /// 1 on the first attempt.
    pub attempt: u32,
    /// Epoch ms.
    pub due_at: i64,
    /// A series' occurrence before its jitter, epoch ms.
    pub scheduled_at: Option<i64>,
    /// The Redis clock when the reserve call took it, epoch ms.
    pub reserved_at: i64,
    /// The reserve call held due jobs of the topic back for its rate limit.
    pub throttled: bool,
    /// The topic's last pause that ended, (paused at, resumed at) on the Redis clock,
    /// epoch ms; `None`: none recorded. The span's `redisched.paused_ms` is its overlap
    /// with `[due_at, reserved_at]`.
    pub pause: Option<(i64, i64)>,
}

/// A command over HTTP.
#[derive(Debug, Clone, Copy)]
pub struct HttpCommand<'a> {
    pub method: &'static str,
    /// The route template, e.g. `/v1/topics/{topic}/jobs/{id}`.
    pub route: &'static str,
    pub topic: &'a str,
    pub id: &'a str,
}

/// The span of a command taken in over AMQP: a child of the producer's span when its
/// headers carry a valid `traceparent`. Record its end with [`record_outcome`].
pub fn ingest_span(headers: Option<&FieldTable>, command: &Ingest<'_>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = make_ingest_span(command);
    adopt(&span, headers.and_then(TraceContext::of_headers).as_ref());
    span
}

fn make_ingest_span(command: &Ingest<'_>) -> Span {
    let name = format!("process {}", command.exchange);
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "ingest",
        otel.name = name.as_str(),
        otel.kind = "consumer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "process",
        messaging.operation.name = "consume",
        messaging.destination.name = command.exchange,
        messaging.rabbitmq.destination.routing_key = command.routing_key,
        messaging.message.id = Empty,
        redisched.topic = command.routing_key,
        redisched.outcome = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    );
    if let Some(id) = command.message_id {
        span.record("messaging.message.id", id);
    }
    span
}

/// The span of one delivery attempt: a child of the context stored in the job's headers
/// (`traceparent`), or a new trace without one. Keep it open until the broker confirmed
/// or the receiver answered; record how it ended with [`record_outcome`] (and
/// [`record_http_status`] for a webhook).
pub fn delivery_span(stored: Option<&FieldTable>, delivery: &Delivery<'_>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = make_delivery_span(delivery);
    adopt(&span, stored.and_then(TraceContext::of_headers).as_ref());
    span
}

fn make_delivery_span(delivery: &Delivery<'_>) -> Span {
    let (system, kind, operation, destination) = match delivery.via {
        Via::Amqp { exchange } => ("rabbitmq", "producer", "publish", exchange),
        Via::Webhook { target } => ("http", "client", "post", target),
    };
    let name = format!("send {destination}");
    let span = tracing::info_span!(
        target: TARGET,
        parent: None,
        "delivery",
        otel.name = name.as_str(),
        otel.kind = kind,
        messaging.system = system,
        messaging.operation.type = "send",
        messaging.operation.name = operation,
        messaging.destination.name = destination,
        messaging.rabbitmq.destination.routing_key = Empty,
        messaging.message.id = delivery.id,
        redisched.topic = delivery.topic,
        redisched.attempt = i64::from(delivery.attempt),
        redisched.due_at = delivery.due_at,
        redisched.scheduled_at = Empty,
        redisched.reserved_at = delivery.reserved_at,
        redisched.due_ms = delivery.reserved_at.saturating_sub(delivery.due_at).max(0),
        redisched.paused_ms = paused_ms(delivery.due_at, delivery.reserved_at, delivery.pause),
        redisched.throttled = delivery.throttled,
        redisched.outcome = Empty,
        http.response.status_code = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    );
    if let Via::Amqp { .. } = delivery.via {
        span.record("messaging.rabbitmq.destination.routing_key", delivery.topic);
    }
    if let Some(at) = delivery.scheduled_at {
        span.record("redisched.scheduled_at", at);
    }
    span
}

/// How much of a job's due wait `[due_at, reserved_at]` fell within its topic's pause
/// `(paused at, resumed at)`, ms; 0 without one. A pause still lasting needs no case:
/// a paused topic gives no jobs.
fn paused_ms(due_at: i64, reserved_at: i64, pause: Option<(i64, i64)>) -> i64 {
    pause.map_or(0, |(since, until)| {
        reserved_at
            .min(until)
            .saturating_sub(due_at.max(since))
            .max(0)
    })
}

/// The span of a command over HTTP: a child of the request's trace context when valid.
/// Record the answer with [`record_http_status`].
pub fn http_command_span(trace: Option<&TraceContext>, command: &HttpCommand<'_>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let span = make_http_command_span(command);
    adopt(&span, trace);
    span
}

fn make_http_command_span(command: &HttpCommand<'_>) -> Span {
    let name = format!("{} {}", command.method, command.route);
    tracing::info_span!(
        target: TARGET,
        parent: None,
        "http_command",
        otel.name = name.as_str(),
        otel.kind = "server",
        http.request.method = command.method,
        http.route = command.route,
        redisched.topic = command.topic,
        redisched.id = command.id,
        redisched.outcome = Empty,
        http.response.status_code = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    )
}

/// How a command or an attempt ended (`applied`, `duplicate`, `invalid`; `confirmed`,
/// `nacked`, `returned`, `parked`, …); `failure`: why it failed, which marks the span as
/// an error.
pub fn record_outcome(span: &Span, outcome: &str, failure: Option<&str>) {
    span.record("redisched.outcome", outcome);
    if let Some(reason) = failure {
        span.record("otel.status_description", reason);
        span.record("otel.status_code", "ERROR");
    }
}

/// The HTTP status of a webhook's answer, or of our answer to a command over HTTP; a 5xx
/// marks the span as an error (HTTP's conventions; a webhook sink that counts a 4xx as
/// a failure says so with [`record_outcome`]).
pub fn record_http_status(span: &Span, status: u16) {
    span.record("http.response.status_code", i64::from(status));
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
}

/// The trace context a delivered job carries: the span's own while exported (its trace
/// is the stored one's, so the consumer stays in the producer's trace), else `stored`.
pub fn outgoing(span: &Span, stored: Option<TraceContext>) -> Option<TraceContext> {
    if enabled() {
        if let Some(own) = own_context(span) {
            return Some(own);
        }
    }
    stored
}

/// Writes the attempt's own context into the headers of the message being published, in
/// place of the stored one; leaves them as they are when export is off.
pub fn inject_amqp(span: &Span, table: &mut FieldTable) {
    if !enabled() {
        return;
    }
    if let Some(own) = own_context(span) {
        own.insert_into(table);
    }
}

/// Sets `traceparent` (and `tracestate`, or removes it) on a webhook request to `cx`
/// ([`outgoing`]'s context); with none, the headers are left as they are.
pub fn inject_http(cx: Option<&TraceContext>, request_headers: &mut reqwest::header::HeaderMap) {
    use reqwest::header::HeaderValue;
    let Some(cx) = cx else {
        return;
    };
    // Both are checked ASCII, so they are valid header values.
    if let Ok(value) = HeaderValue::from_str(cx.traceparent()) {
        request_headers.insert(headers::TRACEPARENT, value);
    }
    match cx.tracestate().map(HeaderValue::from_str) {
        Some(Ok(value)) => {
            request_headers.insert(headers::TRACESTATE, value);
        }
        _ => {
            request_headers.remove(headers::TRACESTATE);
        }
    }
}

/// The context of a span the OpenTelemetry layer knows, if it has a valid one.
fn own_context(span: &Span) -> Option<TraceContext> {
    if span.is_none() {
        return None;
    }
    let cx = span.context();
    let own = cx.span().span_context().clone();
    if !own.is_valid() {
        return None;
    }
    let state = own.trace_state().header();
    TraceContext::from_parts(
        u128::from_be_bytes(own.trace_id().to_bytes()),
        u64::from_be_bytes(own.span_id().to_bytes()),
        own.trace_flags().to_u8(),
        (!state.is_empty()).then_some(state.as_str()),
    )
}

/// Makes `parent` (a context from elsewhere) the span's parent.
fn adopt(span: &Span, parent: Option<&TraceContext>) {
    let Some(parent) = parent else {
        return;
    };
    let state = parent
        .tracestate()
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    let remote = SpanContext::new(
        TraceId::from(parent.trace_id()),
        SpanId::from(parent.parent_id()),
        TraceFlags::new(parent.flags()),
        true,
        state,
    );
    // Fails only for a span the layer does not know (none is installed): nothing to do.
    span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote))
        .ok();
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanKind, Status, TracerProvider as _};
    use opentelemetry::Value;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::Layer as _;

    use super::*;

    const PRODUCER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// Spans as the SDK hands them to an exporter, kept for the test to read.
    #[derive(Debug, Clone, Default)]
    struct Kept(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Kept {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    /// Runs `make` under a subscriber with the OpenTelemetry layer as `init` sets it up
    /// (its filter included), sampling `ratio` of new traces; the spans it exported.
    fn exported(ratio: f64, make: impl FnOnce()) -> Vec<SpanData> {
        let kept = Kept::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(kept.clone())
            .with_sampler(super::super::export::sampler(ratio))
            .build();
        let layer = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("test"))
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target(TARGET, tracing::Level::TRACE),
            );
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, make);
        provider.force_flush().unwrap();
        let spans = kept.0.lock().unwrap().clone();
        spans
    }

    fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| &kv.value)
    }

    fn stored(traceparent: &str) -> FieldTable {
        let mut table = FieldTable::default();
        TraceContext::parse(traceparent, Some("rojo=00f067aa0ba902b7"))
            .unwrap()
            .insert_into(&mut table);
        table
    }

    const DELIVERY: Delivery<'static> = Delivery {
        via: Via::Amqp {
            exchange: "redisched.ready",
        },
        topic: "mail",
        id: "job-1",
        attempt: 2,
        due_at: 1_000,
        scheduled_at: Some(900),
        reserved_at: 4_500,
        throttled: true,
        pause: Some((500, 2_000)),
    };

    #[test]
    fn paused_ms_is_the_part_of_the_due_wait_within_the_pause() {
        let (due, reserved) = (1_000, 4_000);
        for (pause, want) in [
            (None, 0),
            // Paused before it came due, resumed before it was taken.
            (Some((500, 2_000)), 1_000),
            // Came due before the pause, taken by the reply that found it running.
            (Some((3_000, 4_000)), 1_000),
            // Within the wait; the whole wait.
            (Some((1_500, 2_500)), 1_000),
            (Some((0, 4_000)), 3_000),
            // Ended before it came due, or began after it was taken.
            (Some((0, 1_000)), 0),
            (Some((200, 800)), 0),
            (Some((4_000, 5_000)), 0),
        ] {
            assert_eq!(paused_ms(due, reserved, pause), want, "{pause:?}");
        }
        assert_eq!(
            paused_ms(5_000, 4_000, Some((0, 9_000))),
            0,
            "never negative"
        );
        assert_eq!(
            paused_ms(i64::MIN, i64::MAX, Some((i64::MIN, i64::MAX))),
            i64::MAX
        );
    }

    #[test]
    fn off_every_helper_is_free_and_changes_nothing() {
        // No test enables export: this is the state of every bridge without an endpoint.
        assert!(!enabled());
        let table = stored(PRODUCER);
        assert!(delivery_span(Some(&table), &DELIVERY).is_none());
        let ingest = Ingest {
            exchange: "c",
            routing_key: "t",
            message_id: None,
        };
        assert!(ingest_span(Some(&table), &ingest).is_none());
        let command = HttpCommand {
            method: "PUT",
            route: "/r",
            topic: "t",
            id: "i",
        };
        assert!(http_command_span(None, &command).is_none());
        let mut after = table.clone();
        inject_amqp(&Span::none(), &mut after);
        assert_eq!(after, table);
        let cx = TraceContext::of_headers(&table);
        assert_eq!(outgoing(&Span::none(), cx.clone()), cx);
        let mut request = reqwest::header::HeaderMap::new();
        request.insert("tracestate", "stale=1".parse().unwrap());
        inject_http(cx.as_ref(), &mut request);
        assert_eq!(request.get("traceparent").unwrap(), PRODUCER);
        assert_eq!(request.get("tracestate").unwrap(), "rojo=00f067aa0ba902b7");
        let bare = TraceContext::parse(PRODUCER, None);
        inject_http(bare.as_ref(), &mut request);
        assert_eq!(request.get("tracestate"), None, "a stale tracestate goes");
        let mut untouched = reqwest::header::HeaderMap::new();
        inject_http(None, &mut untouched);
        assert!(untouched.is_empty());
    }

    #[test]
    fn a_delivery_span_continues_the_stored_trace_with_its_attributes() {
        let table = stored(PRODUCER);
        let mut own = None;
        let spans = exported(1.0, || {
            let span = make_delivery_span(&DELIVERY);
            adopt(&span, TraceContext::of_headers(&table).as_ref());
            own = own_context(&span);
            record_outcome(&span, "returned", Some("unroutable"));
        });
        assert_eq!(spans.len(), 1);
        let span = &spans[0];
        let producer = TraceContext::parse(PRODUCER, None).unwrap();
        assert_eq!(span.name, "send redisched.ready");
        assert_eq!(span.span_kind, SpanKind::Producer);
        assert_eq!(
            span.span_context.trace_id(),
            TraceId::from(producer.trace_id())
        );
        assert_eq!(span.parent_span_id, SpanId::from(producer.parent_id()));
        assert!(span.parent_span_is_remote);
        for (key, value) in [
            ("messaging.system", Value::from("rabbitmq")),
            ("messaging.operation.type", Value::from("send")),
            ("messaging.destination.name", Value::from("redisched.ready")),
            (
                "messaging.rabbitmq.destination.routing_key",
                Value::from("mail"),
            ),
            ("messaging.message.id", Value::from("job-1")),
            ("redisched.topic", Value::from("mail")),
            ("redisched.attempt", Value::I64(2)),
            ("redisched.due_at", Value::I64(1_000)),
            ("redisched.scheduled_at", Value::I64(900)),
            ("redisched.reserved_at", Value::I64(4_500)),
            ("redisched.due_ms", Value::I64(3_500)),
            ("redisched.paused_ms", Value::I64(1_000)),
            ("redisched.throttled", Value::Bool(true)),
            ("redisched.outcome", Value::from("returned")),
        ] {
            assert_eq!(attr(span, key), Some(&value), "{key}");
        }
        assert_eq!(span.status, Status::error("unroutable"));
        // What the consumer gets: this attempt's context, in the producer's trace, with
        // the producer's tracestate.
        let own = own.expect("an exported span has a context");
        assert_eq!(own.trace_id(), producer.trace_id());
        assert_eq!(
            own.parent_id(),
            u64::from_be_bytes(span.span_context.span_id().to_bytes())
        );
        assert_eq!(own.tracestate(), Some("rojo=00f067aa0ba902b7"));
    }

    #[test]
    fn webhook_and_ingest_and_http_spans_name_their_system() {
        let webhook = Delivery {
            via: Via::Webhook { target: "billing" },
            scheduled_at: None,
            ..DELIVERY
        };
        let spans = exported(1.0, || {
            let span = make_delivery_span(&webhook);
            record_http_status(&span, 503);
            drop(span);
            let ingest = Ingest {
                exchange: "redisched.commands",
                routing_key: "mail",
                message_id: Some("job-1"),
            };
            let span = make_ingest_span(&ingest);
            adopt(&span, TraceContext::of_headers(&stored(PRODUCER)).as_ref());
            record_outcome(&span, "applied", None);
            drop(span);
            let command = HttpCommand {
                method: "PUT",
                route: "/v1/topics/{topic}/jobs/{id}",
                topic: "mail",
                id: "job-2",
            };
            let span = make_http_command_span(&command);
            record_http_status(&span, 201);
        });
        assert_eq!(spans.len(), 3);
        let (hook, ingest, http) = (&spans[0], &spans[1], &spans[2]);
        assert_eq!(hook.name, "send billing");
        assert_eq!(hook.span_kind, SpanKind::Client);
        assert_eq!(attr(hook, "messaging.system"), Some(&Value::from("http")));
        assert_eq!(
            attr(hook, "messaging.rabbitmq.destination.routing_key"),
            None
        );
        assert_eq!(attr(hook, "redisched.scheduled_at"), None);
        assert_eq!(attr(hook, "redisched.paused_ms"), Some(&Value::I64(1_000)));
        assert_eq!(
            attr(hook, "http.response.status_code"),
            Some(&Value::I64(503))
        );
        assert!(matches!(hook.status, Status::Error { .. }));
        assert_eq!(
            hook.parent_span_id,
            SpanId::INVALID,
            "no stored context: a root"
        );

        assert_eq!(ingest.name, "process redisched.commands");
        assert_eq!(ingest.span_kind, SpanKind::Consumer);
        assert_eq!(
            attr(ingest, "messaging.message.id"),
            Some(&Value::from("job-1"))
        );
        assert_eq!(
            attr(ingest, "redisched.outcome"),
            Some(&Value::from("applied"))
        );
        assert_eq!(ingest.status, Status::Unset);
        let producer = TraceContext::parse(PRODUCER, None).unwrap();
        assert_eq!(ingest.parent_span_id, SpanId::from(producer.parent_id()));

        assert_eq!(http.name, "PUT /v1/topics/{topic}/jobs/{id}");
        assert_eq!(http.span_kind, SpanKind::Server);
        assert_eq!(attr(http, "redisched.id"), Some(&Value::from("job-2")));
        assert_eq!(
            attr(http, "http.response.status_code"),
            Some(&Value::I64(201))
        );
    }

    #[test]
    fn sampling_follows_the_producer_and_the_ratio_applies_to_new_traces() {
        let unsampled = PRODUCER.replace("-01", "-00");
        let spans = exported(0.0, || {
            // The producer recorded its span: so do we, whatever the ratio.
            let span = make_delivery_span(&DELIVERY);
            adopt(&span, TraceContext::parse(PRODUCER, None).as_ref());
            drop(span);
            // A new trace at ratio 0: not recorded.
            drop(make_delivery_span(&DELIVERY));
        });
        assert_eq!(spans.len(), 1);
        let spans = exported(1.0, || {
            // The producer did not record: neither do we, and the consumer still gets
            // the producer's trace (a context, not sampled).
            let span = make_delivery_span(&DELIVERY);
            let producer = TraceContext::parse(&unsampled, None).unwrap();
            adopt(&span, Some(&producer));
            let own = own_context(&span).expect("a context even unsampled");
            assert_eq!(own.trace_id(), producer.trace_id());
            assert!(!own.sampled());
        });
        assert!(spans.is_empty());
    }

    #[test]
    fn events_and_other_spans_are_not_exported() {
        let spans = exported(1.0, || {
            let _other = tracing::info_span!("dispatch").entered();
            tracing::info!("a log line");
            let span = make_http_command_span(&HttpCommand {
                method: "POST",
                route: "/schedule/{topic}",
                topic: "t",
                id: "i",
            });
            let _in = span.enter();
            tracing::warn!("inside our span: stays in the log");
        });
        assert_eq!(spans.len(), 1);
        assert!(spans[0].events.is_empty());
        assert_eq!(spans[0].parent_span_id, SpanId::INVALID, "explicit root");
    }
}

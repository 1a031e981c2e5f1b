#!/usr/bin/env python3
"""A producer and a consumer instrumented with PyPI opentelemetry-instrumentation-pika, as a
team that traces its services would run them (tests/bridge/trace_context.rs drives it).

Usage: pika_tracing.py AMQP_URL COMMANDS_EXCHANGE READY_EXCHANGE TOPIC DELAY_MS REST_ID

The consumer binds a queue to READY_EXCHANGE for TOPIC and prints `bound`; the producer then
publishes, inside a span of its own, a put (`once`) and a recurring put (`series`, every
second) with `x-delay: DELAY_MS`; meanwhile the test puts REST_ID over REST with a
traceparent of its own. Once `once`, two occurrences of `series` and REST_ID have arrived
(20 s at most), the series is deleted and one JSON line is printed: every finished span (the
SDK's in-memory exporter) and, per delivery, the headers and the trace id of the consumer's
span.
"""
import json
import sys
import time

import pika
from opentelemetry.instrumentation.pika import PikaInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry import trace

url, commands, ready, topic, delay_ms, rest_id = sys.argv[1:7]
delay_ms = int(delay_ms)

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))

connection = pika.BlockingConnection(pika.URLParameters(url))
consumer = connection.channel()
queue = consumer.queue_declare("", exclusive=True).method.queue
consumer.queue_bind(queue, ready, routing_key=topic)
received = []


def text(value):
    return value.decode() if isinstance(value, bytes) else value


def on_job(channel, method, properties, body):
    span = trace.get_current_span()
    headers = properties.headers or {}
    received.append({
        "id": properties.message_id,
        "at": time.time(),
        "traceparent": text(headers.get("traceparent")),
        "tracestate": text(headers.get("tracestate")),
        "trace_id": format(span.get_span_context().trace_id, "032x"),
        "span_id": format(span.get_span_context().span_id, "016x"),
    })
    channel.basic_ack(method.delivery_tag)


consumer.basic_consume(queue, on_job)
PikaInstrumentor.instrument_channel(consumer, tracer_provider=provider)
producer = connection.channel()
PikaInstrumentor.instrument_channel(producer, tracer_provider=provider)
print("bound", flush=True)

tracer = provider.get_tracer("producer-app")
sent = time.time()
with tracer.start_as_current_span("schedule reminders"):
    for job_id, extra in [("once", {}), ("series", {"x-redisched-every": 1000})]:
        headers = {"x-delay": delay_ms, **extra}
        producer.basic_publish(
            commands,
            topic,
            b"remind me",
            pika.BasicProperties(message_id=job_id, headers=headers, delivery_mode=2),
        )


def count(job_id):
    return sum(1 for r in received if r["id"] == job_id)


deadline = time.time() + 20
while time.time() < deadline and (count("once") < 1 or count("series") < 2 or count(rest_id) < 1):
    connection.process_data_events(time_limit=0.2)
producer.basic_publish(
    commands, topic, b"", pika.BasicProperties(message_id="series", headers={"x-redisched-op": "delete"})
)
connection.close()

spans = [
    {
        "name": s.name,
        "kind": s.kind.name,
        "trace_id": format(s.context.trace_id, "032x"),
        "span_id": format(s.context.span_id, "016x"),
        "parent_span_id": format(s.parent.span_id, "016x") if s.parent else None,
    }
    for s in exporter.get_finished_spans()
]
print(json.dumps({"sent": sent, "delay_ms": delay_ms, "received": received, "spans": spans}), flush=True)

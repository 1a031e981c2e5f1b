"""Print jobs as they come due (at-least-once: dedupe on message_id). `pip install pika`."""
import os
import pika

params = pika.URLParameters(os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
channel = pika.BlockingConnection(params).channel()
channel.queue_declare("emails", durable=True)
channel.queue_bind("emails", "redisched.ready", routing_key="emails")

def on_job(ch, method, props, body):
    h = props.headers or {}
    print(props.message_id, "due", h.get("x-redisched-due-at"), "attempt", h.get("x-redisched-attempt"), body)
    ch.basic_ack(method.delivery_tag)

channel.basic_consume("emails", on_job)
channel.start_consuming()

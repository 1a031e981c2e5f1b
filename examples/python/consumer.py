"""Print jobs as they come due on redisched.ready. Delivery is at-least-once: dedupe on
message_id if a duplicate would hurt. `pip install -r requirements.txt` (pika).
Settings: AMQP_URL, READY_EXCHANGE (redisched.ready), QUEUE (emails), TOPIC (emails)."""
import os

import pika

url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
exchange = os.environ.get("READY_EXCHANGE", "redisched.ready")
queue = os.environ.get("QUEUE", "emails")
topic = os.environ.get("TOPIC", "emails")

channel = pika.BlockingConnection(pika.URLParameters(url)).channel()
channel.queue_declare(queue, durable=True)  # jobs due while you are away wait here
channel.queue_bind(queue, exchange, routing_key=topic)  # routing key = topic


def on_job(ch, method, props, body):
    due = (props.headers or {}).get("x-redisched-due-at")
    print(f"job {props.message_id} due at {due}: {body.decode()}", flush=True)
    ch.basic_ack(method.delivery_tag)  # after the work is done


print(f"waiting for jobs on queue {queue}", flush=True)
channel.basic_consume(queue, on_job)
channel.start_consuming()

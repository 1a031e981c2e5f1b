"""Schedule a job by the id you choose, replace it, cancel it, then schedule another (which
consumer.py receives). Each command waits for the broker's confirm and the bridge's reply.
Run `redisched run` first. `pip install -r requirements.txt` (pika).
Settings: AMQP_URL, COMMANDS_EXCHANGE (redisched.commands), TOPIC (emails)."""
import json
import os
import uuid

import pika

url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
exchange = os.environ.get("COMMANDS_EXCHANGE", "redisched.commands")
topic = os.environ.get("TOPIC", "emails")

connection = pika.BlockingConnection(pika.URLParameters(url))
channel = connection.channel()
channel.confirm_delivery()  # basic_publish now waits for the broker's confirm, raises if refused
replies = channel.queue_declare("", exclusive=True).method.queue  # the bridge answers here
answers = channel.consume(replies, auto_ack=True, inactivity_timeout=10)


def command(op, job_id, body="", delay_ms=None):
    """One command at a time, for clarity: a busy producer publishes many and matches the
    replies by correlation_id."""
    headers = {"x-redisched-op": op}
    if delay_ms is not None:
        headers["x-delay"] = delay_ms
    correlation = str(uuid.uuid4())
    channel.basic_publish(
        exchange,
        routing_key=topic,  # the topic
        body=body.encode(),
        properties=pika.BasicProperties(
            message_id=job_id,  # the job id you choose
            content_type="text/plain",
            headers=headers,
            reply_to=replies,
            correlation_id=correlation,
        ),
    )
    method, props, reply = next(answers)  # the bridge's reply: Redis has applied it
    if method is None:
        raise SystemExit(f"{op} {job_id}: no reply in 10 s; is `redisched run` up?")
    if props.correlation_id != correlation:
        raise SystemExit(f"{op} {job_id}: a reply to another command")
    print(f"{op} {job_id}: {reply.decode()}", flush=True)
    answer = json.loads(reply)
    if answer["status"] == "invalid":
        raise SystemExit(f"{op} {job_id}: invalid: {answer['error']}")


command("put", "need_some_help_email_42", "Hi 42, need some help?", delay_ms=3000)
command("replace", "need_some_help_email_42", "Hi 42, need some help? Just reply.", delay_ms=3000)
command("delete", "need_some_help_email_42")  # user 42 found their way: cancel
command("put", "need_some_help_email_43", "Hi 43, need some help?", delay_ms=3000)
connection.close()

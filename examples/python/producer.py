"""Schedule a job 5 s out, then cancel another by id. `pip install pika`."""
import os
import pika

params = pika.URLParameters(os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
connection = pika.BlockingConnection(params)
channel = connection.channel()
channel.confirm_delivery()  # publish() now raises if the broker refuses

def command(topic, job_id, body=b"", op="put", delay_ms=0):
    channel.basic_publish(
        exchange="redisched.commands",
        routing_key=topic,  # the topic
        body=body,
        properties=pika.BasicProperties(
            message_id=job_id,  # the job id you choose
            content_type="text/plain",
            headers={"x-redisched-op": op, "x-delay": delay_ms},
        ),
    )

command("emails", "need_some_help_email_42", b"Need some help?", delay_ms=5000)
command("emails", "need_some_help_email_43", b"Need some help?", delay_ms=5000)
command("emails", "need_some_help_email_43", op="delete")  # user 43 acted first
connection.close()

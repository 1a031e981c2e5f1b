// Print jobs as they come due on redisched.ready. Delivery is at-least-once: dedupe on
// message_id if a duplicate would hurt. `npm ci` here installs amqplib; `node consumer.mjs`.
// Settings: AMQP_URL, READY_EXCHANGE (redisched.ready), QUEUE (emails), TOPIC (emails).
import amqp from "amqplib";

const url = process.env.AMQP_URL ?? "amqp://guest:guest@127.0.0.1:5672/%2f";
const exchange = process.env.READY_EXCHANGE ?? "redisched.ready";
const queue = process.env.QUEUE ?? "emails";
const topic = process.env.TOPIC ?? "emails";

const connection = await amqp.connect(url);
const channel = await connection.createChannel();
await channel.assertQueue(queue, { durable: true }); // jobs due while you are away wait here
await channel.bindQueue(queue, exchange, topic); // routing key = topic
console.log(`waiting for jobs on queue ${queue}`);
await channel.consume(queue, (job) => {
  const due = job.properties.headers?.["x-redisched-due-at"];
  console.log(`job ${job.properties.messageId} due at ${due}: ${job.content.toString()}`);
  channel.ack(job); // after the work is done
});

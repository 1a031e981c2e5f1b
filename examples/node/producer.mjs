// Schedule a job by the id you choose, replace it, cancel it, then schedule another (which
// consumer.mjs receives). Each command waits for the broker's confirm and the bridge's reply.
// Run `redisched run` first; `npm ci` here installs amqplib; then `node producer.mjs`.
// Settings: AMQP_URL, COMMANDS_EXCHANGE (redisched.commands), TOPIC (emails).
import { randomUUID } from "node:crypto";
import amqp from "amqplib";

const url = process.env.AMQP_URL ?? "amqp://guest:guest@127.0.0.1:5672/%2f";
const exchange = process.env.COMMANDS_EXCHANGE ?? "redisched.commands";
const topic = process.env.TOPIC ?? "emails";

const connection = await amqp.connect(url);
const channel = await connection.createConfirmChannel();
const { queue: replies } = await channel.assertQueue("", { exclusive: true }); // the bridge answers here
const waiting = new Map(); // correlation_id -> the command waiting for its reply
await channel.consume(replies, (msg) => waiting.get(msg.properties.correlationId)?.(msg.content.toString()), {
  noAck: true,
});

async function command(op, id, body = "", delayMs = undefined) {
  const correlationId = randomUUID();
  const reply = new Promise((resolve, reject) => {
    waiting.set(correlationId, resolve);
    setTimeout(() => reject(new Error(`${op} ${id}: no reply in 10 s; is \`redisched run\` up?`)), 10_000).unref();
  });
  const headers = { "x-redisched-op": op };
  if (delayMs !== undefined) headers["x-delay"] = delayMs;
  channel.publish(exchange, topic /* routing key = topic */, Buffer.from(body), {
    messageId: id, // the job id you choose
    contentType: "text/plain",
    headers,
    replyTo: replies,
    correlationId,
  });
  await channel.waitForConfirms(); // the broker has the command (rejects if it refused it)
  const answer = await reply; // the bridge's reply: Redis has applied it
  waiting.delete(correlationId);
  console.log(`${op} ${id}: ${answer}`);
  const { status, error } = JSON.parse(answer);
  if (status === "invalid") throw new Error(`${op} ${id}: invalid: ${error}`);
}

await command("put", "need_some_help_email_42", "Hi 42, need some help?", 3000);
await command("replace", "need_some_help_email_42", "Hi 42, need some help? Just reply.", 3000);
await command("delete", "need_some_help_email_42"); // user 42 found their way: cancel
await command("put", "need_some_help_email_43", "Hi 43, need some help?", 3000);
await connection.close();

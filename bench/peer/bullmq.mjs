// BullMQ on the same Redis, measured the way redisched-bench measures redisched.
//
//   node bench/peer/bullmq.mjs [--json] [--jobs 100000] [--rates 1000,5000] [--seconds 30]
//        [--max-delay-ms 10000] [--warm-up-ms <max delay>] [--body-bytes 100]
//        [--redis redis://127.0.0.1:6379/0]
//
// Phase 1: add N delayed jobs (delay 1 h) with custom ids (jobId, 20 bytes) in addBulk
// chunks of 1,000; Redis bytes per delayed job = INFO used_memory delta / N (and the
// MEMORY USAGE of the keys, which other clients of a shared Redis do not disturb);
// then remove every one of them by id (queue.remove, 1,000 concurrent).
// Phase 2: a Worker (concurrency 100, no-op) processes jobs added at R/s with random
// delays 0..max; lateness = processedOn - (timestamp + delay). Jobs are added for
// warm-up + seconds, and only those due in the last `seconds` count (steady state: jobs
// fall due at the full rate while they are still added at it), as redisched-bench does.
// Everything lives under its own prefix, obliterated at the end.

import { Queue, Worker } from 'bullmq';
import IORedis from 'ioredis';

const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < args.length ? args[i + 1] : dflt;
};
const asJson = args.includes('--json');
const jobs = Number(opt('jobs', '100000'));
const rates = opt('rates', '1000,5000').split(',').filter(Boolean).map(Number);
const seconds = Number(opt('seconds', '30'));
const maxDelay = Number(opt('max-delay-ms', '10000'));
const warmUp = Number(opt('warm-up-ms', String(maxDelay)));
const bodyBytes = Number(opt('body-bytes', '100'));
const redisUrl = opt('redis', process.env.REDISCHED_REDIS__URL || 'redis://127.0.0.1:6379/0');
const prefix = opt('prefix', `bench-bullmq-${process.pid}-${Date.now().toString(16)}`);

const log = (...m) => process.stderr.write(m.join(' ') + '\n');
const connection = () => new IORedis(redisUrl, { maxRetriesPerRequest: null });
const body = 'x'.repeat(bodyBytes);
const idOf = (kind, n) => `${kind}-${String(n).padStart(16, '0')}`; // 20 bytes for "job-"

function percentiles(values) {
  values.sort((a, b) => a - b);
  const q = (p) => (values.length ? values[Math.min(values.length, Math.max(1, Math.ceil(p * values.length))) - 1] : 0);
  return {
    count: values.length,
    p50_ms: q(0.5),
    p99_ms: q(0.99),
    p999_ms: q(0.999),
    max_ms: values.length ? values[values.length - 1] : 0,
    early: values.filter((v) => v < 0).length,
  };
}

// About 200 points of the sorted values: [ms, fraction <= ms] (as redisched-bench).
function cdf(sorted) {
  if (!sorted.length) return [];
  const fractions = [];
  for (let i = 0; i <= 190; i++) fractions.push(i / 200);
  fractions.push(0.96, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0);
  return fractions.map((f) => [sorted[Math.min(sorted.length, Math.max(1, Math.ceil(f * sorted.length))) - 1], f]);
}

async function usedMemory(redis) {
  const info = await redis.info('memory');
  const m = /used_memory:(\d+)/.exec(info);
  return m ? Number(m[1]) : 0;
}

async function keysUsage(redis, pattern) {
  let cursor = '0';
  let bytes = 0;
  let keys = 0;
  do {
    const [next, batch] = await redis.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
    cursor = next;
    if (batch.length) {
      const pipe = redis.pipeline();
      for (const k of batch) pipe.memory('USAGE', k, 'SAMPLES', 0);
      for (const [, v] of await pipe.exec()) bytes += Number(v || 0);
      keys += batch.length;
    }
  } while (cursor !== '0');
  return { bytes, keys };
}

async function phaseAddRemove(redis) {
  const name = 'addremove';
  const queue = new Queue(name, { connection: connection(), prefix });
  await queue.waitUntilReady();
  const before = await usedMemory(redis);
  let t0 = performance.now();
  for (let from = 0; from < jobs; from += 1000) {
    const chunk = [];
    for (let n = from; n < Math.min(jobs, from + 1000); n++) {
      chunk.push({ name: 'j', data: { body }, opts: { jobId: idOf('job', n), delay: 3_600_000 } });
    }
    await queue.addBulk(chunk);
    if ((from / 1000) % 20 === 0) process.stderr.write(`\r  bullmq add: ${from}/${jobs}   `);
  }
  const addSecs = (performance.now() - t0) / 1000;
  const after = await usedMemory(redis);
  const usage = await keysUsage(redis, `${prefix}:${name}:*`);
  log(`\r  bullmq add: ${jobs} delayed jobs in ${addSecs.toFixed(2)} s (${Math.round(jobs / addSecs)}/s)`);
  t0 = performance.now();
  let removed = 0;
  for (let from = 0; from < jobs; from += 1000) {
    const ids = [];
    for (let n = from; n < Math.min(jobs, from + 1000); n++) ids.push(idOf('job', n));
    const r = await Promise.all(ids.map((id) => queue.remove(id)));
    removed += r.filter((x) => x === 1).length;
  }
  const removeSecs = (performance.now() - t0) / 1000;
  log(`  bullmq remove by id: ${removed} in ${removeSecs.toFixed(2)} s (${Math.round(jobs / removeSecs)}/s)`);
  await queue.obliterate({ force: true });
  await queue.close();
  return {
    jobs,
    body_bytes: bodyBytes,
    id_bytes: idOf('job', 0).length,
    add_per_s: Math.round(jobs / addSecs),
    add_method: 'addBulk, 1,000 per call',
    remove_per_s: Math.round(jobs / removeSecs),
    remove_method: 'queue.remove(jobId), 1,000 concurrent',
    removed,
    redis_bytes_per_job_info_delta: Math.round((after - before) / jobs),
    redis_bytes_per_job_memory_usage: Math.round(usage.bytes / jobs),
    keys_per_job: Number((usage.keys / jobs).toFixed(3)),
  };
}

async function phaseLateness(rate) {
  const name = `late${rate}`;
  const queue = new Queue(name, { connection: connection(), prefix });
  const lateness = [];
  const total = Math.round(rate * (seconds + warmUp / 1000));
  let seen = 0;
  // The measured window, on the producer's clock; set when adding starts.
  let from = Infinity;
  let to = -Infinity;
  let done;
  const finished = new Promise((resolve) => (done = resolve));
  const worker = new Worker(
    name,
    async (job) => {
      const due = job.timestamp + job.opts.delay;
      if (due >= from && due < to) lateness.push(job.processedOn - due);
      if (++seen >= total) done();
    },
    { connection: connection(), prefix, concurrency: 100, removeOnComplete: { count: 0 }, removeOnFail: { count: 0 } },
  );
  await worker.waitUntilReady();
  const t0 = performance.now();
  from = Date.now() + warmUp;
  to = from + seconds * 1000;
  let sent = 0;
  while (sent < total) {
    const should = Math.min(total, Math.floor(((performance.now() - t0) / 1000) * rate));
    if (should > sent) {
      const chunk = [];
      for (; sent < should; sent++) {
        chunk.push({ name: 'j', data: { body }, opts: { jobId: idOf('r', sent), delay: Math.floor(Math.random() * (maxDelay + 1)) } });
      }
      await queue.addBulk(chunk);
    }
    await new Promise((r) => setTimeout(r, 5));
  }
  const addSecs = (performance.now() - t0) / 1000;
  const timeout = setTimeout(() => done(), maxDelay + 60_000);
  await finished;
  clearTimeout(timeout);
  await worker.close();
  await queue.obliterate({ force: true });
  await queue.close();
  const stats = percentiles(lateness);
  log(`  bullmq ${rate}/s: ${stats.count} jobs, lateness p50 ${stats.p50_ms} ms, p99 ${stats.p99_ms} ms, p99.9 ${stats.p999_ms} ms, max ${stats.max_ms} ms, early ${stats.early}`);
  return {
    rate_per_s: rate,
    achieved_add_rate_per_s: Math.round(total / addSecs),
    expected: total,
    delivered: seen,
    warm_up_ms: warmUp,
    lateness_ms: stats,
    cdf: cdf(lateness),
  };
}

async function main() {
  const redis = connection();
  const version = (await import('bullmq/package.json', { with: { type: 'json' } }).catch(() => null))?.default?.version;
  log(`bullmq ${version ?? '?'}: prefix ${prefix}`);
  const result = { peer: 'bullmq', version, node: process.version, prefix, max_delay_ms: maxDelay, seconds_per_rate: seconds, warm_up_ms: warmUp };
  try {
    result.add_remove_memory = await phaseAddRemove(redis);
    result.rates = [];
    for (const rate of rates) result.rates.push(await phaseLateness(rate));
  } finally {
    // Whatever is left under the prefix (also after a failure).
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', 1000);
      cursor = next;
      if (keys.length) await redis.unlink(...keys);
    } while (cursor !== '0');
    redis.disconnect();
  }
  if (asJson) process.stdout.write(JSON.stringify(result) + '\n');
  else console.log(JSON.stringify(result, null, 2));
}

main().then(
  () => process.exit(0),
  (err) => {
    log(`bullmq bench failed: ${err?.stack ?? err}`);
    process.exit(1);
  },
);

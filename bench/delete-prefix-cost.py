#!/usr/bin/env python3
"""The work of every delete_prefix.lua step on a large topic, in user-space instructions
Redis executes (valgrind callgrind's Ir: the same for the same data whatever the
machine's load, so a step the machine starves of CPU does not look long).

    bench/delete-prefix-cost.py [jobs]
    bench/delete-prefix-cost.py 1000000

One topic of `jobs` jobs (ids `user_<n % 1000>_<n>`, 100-byte bodies, one due time, as
`tests/bridge/cancel_by_prefix.rs` loads them) is written once to an RDB file. Two
walks then run on servers started from that same file, so they see the same hash
table and do the same steps (40 entries examined, at most 20 removals, history
logged, as the bridge's `Store::delete_prefix`): first one user's prefix `user_7_`,
then `user_`, every job left. (Redis seeds its hash function per process, so the
two servers' steps visit the entries in different orders: the same work, not the
same steps.)

1. Native: each step's time inside Redis (`INFO commandstats` read around it).
2. Under callgrind, counting only inside EVALSHA and dumping after each call: every
   step's own instruction count.

Printed: steps, mean, p99 and max instructions per step, and the max converted to
time at this machine's rate (the median step's instructions over the median step's
native time: the rate of a step the machine did not starve). Needs redis-server, valgrind and redis-py
(`pip install redis`). 1,000,000 jobs take about 40 minutes (the callgrind walk).
"""
import glob, os, statistics, subprocess, sys, tempfile, time

import redis

from redis_callgrind import free_port, total_ir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["scheduled", "reserved", "jobs", "seq", "damaged", "paused", "history", "failing"]
KEYS = [f"big:{{signups}}:{n}" for n in NAMES]
STEP_COUNT = 40  # src/store/ops/delete_prefix.rs PREFIX_STEP
LOAD = """
for n = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  local id = 'user_' .. (n % 1000) .. '_' .. n
  redis.call('HSET', KEYS[1], id, '1|4102444800000|0|0|0|' .. string.rep('x', 100))
  redis.call('ZADD', KEYS[2], 4102444800000, id)
end"""



def start(work, prefix_cmd=()):
    port = free_port()
    server = subprocess.Popen(
        [*prefix_cmd, "redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", work, "--dbfilename", "topic.rdb"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(6000):
        try:
            if r.ping() and r.info("persistence")["loading"] == 0:
                return server, r
        except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
            pass
        time.sleep(0.1)
    raise RuntimeError("redis-server did not start")


def stop(server):
    server.terminate()
    server.wait()


def load(work, jobs):
    server, r = start(work)
    try:
        for first in range(0, jobs, 20000):
            r.eval(LOAD, 2, KEYS[2], KEYS[0], first, min(first + 20000, jobs) - 1)
        r.save()
    finally:
        stop(server)


def walk(r, script, prefix, on_step):
    cursor, steps, deleted = "0", 0, 0
    while True:
        got = script(keys=KEYS, args=[prefix, cursor, STEP_COUNT, 1000])
        cursor, steps, deleted = got[0].decode(), steps + 1, deleted + got[1]
        on_step(got[1])
        if got[2] == 1:
            return steps, deleted


def evalsha_usec(r):
    return r.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0)


def native(work):
    server, r = start(work)
    try:
        script = r.register_script(open(os.path.join(ROOT, "lua/delete_prefix.lua")).read())
        r.script_load(script.script)
        usec = []
        last = [evalsha_usec(r)]

        def take(_deleted):
            now = evalsha_usec(r)
            usec.append(now - last[0])
            last[0] = now

        for prefix in ("user_7_", "user_"):
            walk(r, script, prefix, take)
        return usec
    finally:
        stop(server)


def counted(work):
    out = os.path.join(work, "cg")
    server, r = start(work, ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p",
                             "--collect-atstart=no", "--toggle-collect=evalGenericCommand",
                             "--dump-after=evalGenericCommand", "--dump-instr=no"])
    costs = []

    def take(_deleted):
        # One dump per EVALSHA, written before the reply is sent.
        files = glob.glob(f"{out}.{server.pid}.*")
        if len(files) != 1:
            raise RuntimeError(f"expected one new dump, found {len(files)}")
        costs.append(total_ir(files[0]))
        os.remove(files[0])

    try:
        script = r.register_script(open(os.path.join(ROOT, "lua/delete_prefix.lua")).read())
        r.script_load(script.script)
        walks = [walk(r, script, p, take) for p in ("user_7_", "user_")]
        return walks, costs
    finally:
        stop(server)



def main():
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
    with tempfile.TemporaryDirectory() as work:
        load(work, jobs)
        usec = native(work)
        walks, costs = counted(work)
    if sum(w[1] for w in walks) != jobs or len(costs) != sum(w[0] for w in walks):
        raise RuntimeError(f"walks {walks} over {jobs} jobs, {len(costs)} steps counted")
    ordered = sorted(costs)
    mean = statistics.fmean(costs)
    # Redis seeds its hash function per process, so the two walks' steps differ in
    # order (and slightly in number): the rate is the median step's instructions over
    # the median step's time, the rate of a step the machine did not starve.
    rate = statistics.median(costs) / statistics.median(usec)
    worst = ordered[-1]
    print(f"{jobs:,} jobs; walks: {walks[0][0]:,} steps for user_7_ ({walks[0][1]:,} deleted), "
          f"{walks[1][0]:,} for user_ ({walks[1][1]:,} deleted)")
    print(f"instructions per step: mean {mean:,.0f}, median {ordered[len(ordered) // 2]:,}, "
          f"p99 {ordered[int(len(ordered) * 0.99)]:,}, p99.99 {ordered[int(len(ordered) * 0.9999)]:,}, "
          f"max {worst:,} (step {costs.index(worst) + 1})")
    print(f"native walk: mean {statistics.fmean(usec):,.0f} µs, max {max(usec):,} µs per step inside "
          f"Redis (INFO commandstats); {sum(u > 5000 for u in usec)} steps over 5 ms of wall time; "
          f"median rate {rate:,.0f} instructions per µs")
    print(f"the heaviest step at that rate: {worst / rate / 1000:.2f} ms "
          f"(steps over 1 ms of work: {sum(c > rate * 1000 for c in costs)}, "
          f"over 5 ms: {sum(c > rate * 5000 for c in costs)})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Redis's cost per reserve.lua call with and without `retry_cap` (ARGV 7, the webhook
sink's lanes), in user-space instructions Redis executes (valgrind callgrind's Ir, which
does not depend on the machine's load).

    bench/reserve-lanes-cost.py [jobs] [batch] [runs] [old reserve.lua]
    bench/reserve-lanes-cost.py 20000 64 3 /tmp/reserve-before.lua

Each run starts a private redis-server under callgrind, loads `jobs` jobs (100-byte body,
20-byte id, 40 bytes of meta) with put.lua, zeroes the counters, reserves them all in
calls of `batch` (8 calls per pipeline, the full nine keys, msgpack, as the bridge does),
and dumps: the dump holds the reserve phase alone. Cases: the script before lanes (if
given) and this one called as the AMQP sink calls it (no cap); this one with a cap of
batch / 2 over first attempts only; and with a cap of 0 when every other job is a
retry (the storm: each call skips as many retries as it takes first attempts). Needs
redis-server, valgrind and redis-py (`pip install redis`).
"""
import glob, os, statistics, subprocess, sys, tempfile, time

from redis_callgrind import KEYS, free_port, put_jobs, start_server, total_ir

ROOT = os.path.dirname(os.path.abspath(__file__ + "/.."))


def make_retries(r, jobs):
    """Every other job marked as reserved once before (attempts 1), as retry.lua leaves it."""
    pipe = r.pipeline(transaction=False)
    for i in range(0, jobs, 2):
        rec = r.hget(KEYS[2], f"job-{i:016d}")
        head, rest = rec.split(b"|", 3)[:3], rec.split(b"|", 3)[3]
        pipe.hset(KEYS[2], f"job-{i:016d}", b"|".join([head[0], head[1], b"1", rest]))
    pipe.execute()


def one_run(script, cap, storm, jobs, batch, work):
    out = os.path.join(work, f"cg.{free_port()}")
    server, r = start_server(out)
    try:
        put_jobs(r, os.path.join(ROOT, "lua"), jobs, 100)
        if storm:
            make_retries(r, jobs)
        reserve = r.register_script(open(script).read())
        args = [60000, batch, "", "", "", "msgpack"] + ([] if cap is None else [cap])
        reserve(keys=KEYS, args=[60000, 1, "", "", "", "msgpack"])  # loads the script
        subprocess.run(["callgrind_control", "--zero", str(server.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        calls, taken = 0, 0
        while True:
            pipe = r.pipeline(transaction=False)
            for _ in range(8):
                reserve(keys=KEYS, args=args, client=pipe)
            got = sum(reply[2].count(b"job-") for reply in pipe.execute())
            calls += 8
            taken += got
            if got == 0 or calls >= 2000:
                break
        before = set(glob.glob(out + ".*"))
        subprocess.run(["callgrind_control", "--dump", str(server.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            new = set(glob.glob(out + ".*")) - before
            if new:
                time.sleep(0.5)
                ir = total_ir(new.pop())
                return ir / calls, ir / max(taken, 1)
            time.sleep(0.1)
        raise RuntimeError("no callgrind dump")
    finally:
        server.terminate()
        server.wait()


def main():
    argv = sys.argv[1:]
    jobs, batch, runs = (int(a) for a in (argv[:3] + ["20000", "64", "3"][len(argv[:3]):]))
    old = argv[3] if len(argv) > 3 else None
    new = os.path.join(ROOT, "lua/reserve.lua")
    cases = ([("before lanes, no cap", old, None, False)] if old else []) + [
        ("this script, no cap (AMQP sink)", new, None, False),
        (f"this script, cap {batch // 2}, first attempts only", new, batch // 2, False),
        ("this script, cap 0, every other job a retry", new, 0, True),
    ]
    with tempfile.TemporaryDirectory() as work:
        for name, script, cap, storm in cases:
            values = [one_run(script, cap, storm, jobs, batch, work) for _ in range(runs)]
            per_call = [v[0] for v in values]
            per_job = [v[1] for v in values]
            print(f"{name}: {statistics.median(per_call):,.0f} "
                  f"({min(per_call):,.0f}-{max(per_call):,.0f}) instructions per call, "
                  f"{statistics.median(per_job):,.0f} per job taken; "
                  f"{runs} runs of {jobs} jobs in calls of {batch}")


if __name__ == "__main__":
    main()

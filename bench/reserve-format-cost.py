#!/usr/bin/env python3
"""Redis's cost per reserved job of reserve.lua's two reply formats (ARGV 6 '' or
'msgpack'), in user-space instructions Redis executes (valgrind callgrind's Ir, which
does not depend on the machine's load).

    bench/reserve-format-cost.py [jobs] [batch] [runs]
    bench/reserve-format-cost.py 20000 100 3

Each run starts a private redis-server under callgrind, loads `jobs` jobs (100-byte body,
20-byte id, 40 bytes of meta) with put.lua, zeroes the counters, reserves them all in
calls of `batch` (8 calls per pipeline, the full nine keys, as the bridge does), and
dumps: the dump holds the reserve phase alone. Needs redis-server, valgrind and redis-py
(`pip install redis`).
"""
import glob, os, statistics, subprocess, sys, tempfile, time

from redis_callgrind import KEYS, free_port, put_jobs, start_server, total_ir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def one_run(fmt, jobs, batch, work):
    out = os.path.join(work, f"cg.{fmt or 'arrays'}.{free_port()}")
    server, r = start_server(out)
    try:
        put_jobs(r, os.path.join(ROOT, "lua"), jobs, 100)
        reserve = r.register_script(open(os.path.join(ROOT, "lua/reserve.lua")).read())
        keys = KEYS
        reserve(keys=keys, args=[60000, 1, "", "", "", fmt])  # loads the script
        subprocess.run(["callgrind_control", "--zero", str(server.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        taken = 1
        while True:
            pipe = r.pipeline(transaction=False)
            for _ in range(8):
                reserve(keys=keys, args=[60000, batch, "", "", "", fmt], client=pipe)
            got = 0
            for reply in pipe.execute():
                jobs_field = reply[2]
                got += jobs_field.count(b"job-") if isinstance(jobs_field, bytes) else len(jobs_field)
            taken += got
            if got == 0:
                break
        if taken != jobs:
            raise RuntimeError(f"reserved {taken} of {jobs}")
        before = set(glob.glob(out + ".*"))
        subprocess.run(["callgrind_control", "--dump", str(server.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            new = set(glob.glob(out + ".*")) - before
            if new:
                time.sleep(0.5)
                return total_ir(new.pop()) / (jobs - 1)
            time.sleep(0.1)
        raise RuntimeError("no callgrind dump")
    finally:
        server.terminate()
        server.wait()


def main():
    jobs, batch, runs = (int(a) for a in (sys.argv[1:] + ["20000", "100", "3"][len(sys.argv) - 1:])[:3])
    with tempfile.TemporaryDirectory() as work:
        results = {fmt: [one_run(fmt, jobs, batch, work) for _ in range(runs)] for fmt in ["", "msgpack"]}
    for fmt, values in results.items():
        print(f"reserve.lua, jobs as {fmt or 'RESP arrays'}: {statistics.median(values):,.0f} "
              f"({min(values):,.0f}-{max(values):,.0f}) Redis instructions per reserved job, "
              f"{runs} runs of {jobs} jobs in calls of {batch}")
    arrays, packed = statistics.median(results[""]), statistics.median(results["msgpack"])
    print(f"msgpack / arrays: {packed / arrays:.3f}")


if __name__ == "__main__":
    main()

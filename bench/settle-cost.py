#!/usr/bin/env python3
"""Redis's cost per job of delivering it: reserve.lua (the bridge's call: nine keys,
MessagePack reply) and release.lua (a webhook's `<token>;HTTP 200` lease, history kept),
in user-space instructions Redis executes (valgrind callgrind's Ir, which does not depend
on the machine's load), for one or more copies of the scripts side by side.

    bench/settle-cost.py [--jobs N] [--batch B] [--runs R] [LUA_DIR ...]
    bench/settle-cost.py --batch 16 /tmp/lua-before lua

Each run starts a private redis-server under callgrind, puts N jobs (20-byte id, 200-byte
body, 40 bytes of meta) with that directory's put.lua, then reserves them all in calls of
B jobs (one dump) and releases them all in calls of B leases (another dump). Per job is a
phase's total over N. LUA_DIR defaults to this checkout's lua/; for an older version:
`mkdir /tmp/lua-before && git archive <rev> lua | tar -x -C /tmp/lua-before --strip-components=1`.
Needs redis-server, valgrind, redis-py and msgpack (`pip install redis msgpack`).
"""
import argparse, glob, os, statistics, subprocess, tempfile

import msgpack

from redis_callgrind import KEYS, free_port, put_jobs, start_server, total_ir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def control(pid, *args):
    subprocess.run(["callgrind_control", *args, str(pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_run(lua, jobs, batch, work):
    out = os.path.join(work, f"cg.{free_port()}")
    server, r = start_server(out)
    try:
        put_jobs(r, lua, jobs, 200)
        script = lambda name: r.register_script(open(os.path.join(lua, name + ".lua")).read())
        reserve, release = script("reserve"), script("release")
        keys = KEYS
        # Load both scripts (a call that takes nothing: max 0; a lease of no job).
        reserve(keys=keys, args=[60000, 1, "0", "", "", "msgpack"])
        release(keys=keys[:8], args=["none", "1;HTTP 200", 1000])
        leases = []
        control(server.pid, "--zero")
        while True:
            reply = reserve(keys=keys, args=[60000, batch, "", "", "", "msgpack"])
            taken = msgpack.unpackb(reply[2], raw=False)
            if not taken:
                break
            leases += [(job[0], job[3]) for job in taken]
        control(server.pid, "--dump=reserve")
        released = 0
        for k in range(0, len(leases), batch):
            args = [a for job_id, token in leases[k:k + batch] for a in (job_id, f"{token};HTTP 200")]
            released += release(keys=keys[:8], args=args + [1000])
        control(server.pid, "--dump=release")
        if len(leases) != jobs or released != jobs or r.hlen(keys[2]) != 0:
            raise RuntimeError(f"reserved {len(leases)}, released {released} of {jobs}")
    finally:
        server.terminate()
        server.wait()
    dumps = sorted(glob.glob(out + ".*.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
    return [total_ir(d) / jobs for d in dumps[:2]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("lua", nargs="*", default=[os.path.join(ROOT, "lua")])
    args = ap.parse_args()
    print(f"Redis instructions per job, {args.jobs} jobs, calls of {args.batch}, "
          f"median (min-max) of {args.runs} runs")
    with tempfile.TemporaryDirectory() as work:
        for lua in args.lua:
            runs = [one_run(lua, args.jobs, args.batch, work) for _ in range(args.runs)]
            cells = []
            for name, values in (("reserve", [r[0] for r in runs]), ("release", [r[1] for r in runs]),
                                 ("both", [r[0] + r[1] for r in runs])):
                cells.append(f"{name} {statistics.median(values):,.0f} "
                             f"({min(values):,.0f}-{max(values):,.0f})")
            print(f"{lua}: " + "; ".join(cells))


if __name__ == "__main__":
    main()

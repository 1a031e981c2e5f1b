"""What the bench's Redis instruction counters share: a private redis-server under callgrind
on a free port, jobs loaded through put.lua, and the total instruction count of a dump."""
import os
import socket
import subprocess
import time

import redis

# A topic's keys in the order the scripts take them (lua/README.md, "Key schema").
NAMES = ["scheduled", "reserved", "jobs", "seq", "damaged", "paused", "history", "failing", "rate"]
KEYS = [f"c:{{t}}:{n}" for n in NAMES]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(out):
    """A redis-server under callgrind writing its dumps to `out`.<pid>[.<n>], once it
    answers: (the process, a client of it)."""
    port = free_port()
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p",
         "redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(600):
        try:
            r.ping()
            return server, r
        except redis.ConnectionError:
            time.sleep(0.1)
    server.terminate()
    server.wait()
    raise RuntimeError("the private redis-server did not answer within 60 s")


def put_jobs(r, lua_dir, jobs, body_bytes):
    """`jobs` one-shot jobs due now (20-byte ids, 40 bytes of meta) through put.lua."""
    put = r.register_script(open(os.path.join(lua_dir, "put.lua")).read())
    pipe = r.pipeline(transaction=False)
    for i in range(jobs):
        put(keys=KEYS[:8], args=[f"job-{i:016d}", b"x" * body_bytes, b"m" * 40, "nx", "delay", "0",
                                 "31622400000", "1048576", ""], client=pipe)
        if i % 1000 == 999 or i == jobs - 1:
            pipe.execute()
            pipe = r.pipeline(transaction=False)


def total_ir(path):
    with open(path) as f:
        for line in f:
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")

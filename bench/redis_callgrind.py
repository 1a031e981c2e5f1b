"""What bench/reserve-format-cost.py and bench/delete-prefix-cost.py share: a free port
for a private redis-server, and the total instruction count of a callgrind dump."""
import socket


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def total_ir(path):
    with open(path) as f:
        for line in f:
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")

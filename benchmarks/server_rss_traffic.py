"""Resident memory of `lmserve serve --mode server` under waves of short requests, and after idle.

Starts the built-in model's server, sends waves of short completion requests at a fixed concurrency (each one
sequence of a few pages), and prints the server's
resident memory and KV use after every wave and after the server has been idle a while. With the
KV pool handing out its oldest free page the RSS climbed by the pages each wave touched, on the
way to the whole pool; it should now stay near the KV in use and come back after a burst.

    .venv/bin/python benchmarks/server_rss_traffic.py [--waves 3] [--requests 2000] [--concurrency 64]

Another revision's server, for a before/after run (`python -m` puts the working directory first
on the path, so the server imports the lmserve found there):

    git worktree add /tmp/old REV && cd /tmp/old && \
        PYTHONPATH=. /path/to/lmserve/.venv/bin/python /path/to/lmserve/benchmarks/server_rss_traffic.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_process import ServerProcess, metric, wait_until_idle  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


async def wave(base_url: str, requests: int, concurrency: int, rng: random.Random) -> None:
    queue = list(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            queue.pop()
            words = " ".join(rng.choice(["sea", "ship", "wind", "star", "salt"]) for _ in range(24))
            r = await client.post("/v1/completions", json={"prompt": words, "max_tokens": 8})
            r.raise_for_status()

    async with httpx.AsyncClient(base_url=base_url, timeout=300.0,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="requests per wave")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds idle before the last reading")
    args = ap.parse_args()

    log = os.path.join(tempfile.mkdtemp(), "server.log")
    server = ServerProcess(["--mode", "server"], log).start(timeout=300)
    rng = random.Random(0)
    try:
        pid = server.proc.pid
        print(f"started: RSS {rss_mib(pid):.0f} MiB")
        for i in range(args.waves):
            start = time.monotonic()
            asyncio.run(wave(server.base_url, args.requests, args.concurrency, rng))
            text = wait_until_idle(server.base_url, timeout=60)
            print(f"wave {i + 1}: {args.requests} requests in {time.monotonic() - start:.1f} s, "
                  f"RSS {rss_mib(pid):.0f} MiB, KV in use {metric(text, 'lmserve:kv_cache_usage_perc'):.3f}")
        time.sleep(args.idle)
        print(f"after {args.idle:g} s idle: RSS {rss_mib(pid):.0f} MiB")
    finally:
        server.stop()


if __name__ == "__main__":
    main()

"""`lmserve serve` against llama.cpp's `llama-server` under `lmserve bench`, side by side.

Starts lmserve on the built-in model (mode=server) and each given llama-server build on the same
GGUF file (as many slots as the largest concurrency, continuous batching, as many threads as
this machine has cores), all on loopback. Then, for each concurrency C and repeat, runs the
same `lmserve bench` workload against each server in turn (interleaved): max(64, 2C) random
requests of 261 prompt and 128 output tokens (end-of-sequence ignored), at most C in flight,
new prompts each repeat. Prints per engine the medians of output tokens/s and TTFT, and
lmserve's ratio to each llama.cpp build; draws output tokens/s against concurrency.

Build llama-server from the llama.cpp tree inside the llama-cpp-python sdist (docs/performance.md
has the commands), then:

    .venv/bin/python benchmarks/server_concurrency.py --llama-server native=/path/to/llama-server \
        [--llama-server avx2=/path/to/avx2/llama-server] [--concurrency 1 4 16 64] [--repeats 3] \
        [--opt O2] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from lmserve.config import DEFAULT_OPT_LEVEL
from lmserve.kernels.build import cpu_name
from lmserve.models.builtin import builtin_model_path

PROMPT_TOKENS, OUTPUT_TOKENS = 261, 128


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def bench(lmserve: list[str], url: str, concurrency: int, seed: int, dataset: str = "random",
          num_prompts: int = 0) -> dict:
    """One ``lmserve bench`` run at ``concurrency``: ``num_prompts`` requests (default max(64, 2C)),
    its result file's dict."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_file = f.name
    try:
        subprocess.run([*lmserve, "bench", "--base-url", url, "--dataset", dataset,
                        "--num-prompts", str(num_prompts or max(64, 2 * concurrency)),
                        "--random-input-len", str(PROMPT_TOKENS), "--random-output-len", str(OUTPUT_TOKENS),
                        "--random-range-ratio", "0",
                        "--ignore-eos", "--max-concurrency", str(concurrency), "--no-progress",
                        # new prompts for every run: the prefix cache must not serve them
                        "--seed", str(seed),
                        "--result-file", result_file], check=True, stdout=subprocess.DEVNULL)
        with open(result_file) as f:
            return json.load(f)
    finally:
        os.unlink(result_file)


@dataclass
class Server:
    """One server under test: its command, its URL and its runs by concurrency."""

    name: str
    command: list[str]
    url: str
    runs: dict[int, list[dict]] = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None

    def median(self, c: int, key: str) -> float:
        return statistics.median(r[key] for r in self.runs[c])


def llama_server(name: str, binary: str, port: int, slots: int) -> Server:
    """A llama-server build on the built-in GGUF: ``slots`` sequences of the workload's length,
    continuous batching, one thread per core."""
    threads = str(os.cpu_count() or 1)
    command = [binary, "-m", builtin_model_path(), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(slots * (PROMPT_TOKENS + OUTPUT_TOKENS + 64)), "-cb",
               "-t", threads, "-tb", threads, "--no-webui"]
    return Server(f"llama.cpp {name}", command, f"http://127.0.0.1:{port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--port", type=int, default=8431, help="lmserve's; llama-server builds take the next ones")
    ap.add_argument("--opt", default=None)
    ap.add_argument("--llama-server", action="append", default=[], metavar="NAME=PATH",
                    help="a llama-server build to run side by side (repeatable)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per concurrency and server (new prompts each); the table shows medians")
    args = ap.parse_args()
    lmserve = [sys.executable, "-m", "lmserve.cli"]
    serve = [*lmserve, "serve", "--port", str(args.port), "--mode", "server"]
    servers = [Server(f"lmserve {args.opt or DEFAULT_OPT_LEVEL}", serve + (["--opt", args.opt] if args.opt else []),
                      f"http://127.0.0.1:{args.port}")]
    for i, spec in enumerate(args.llama_server):
        name, _, binary = spec.partition("=")
        servers.append(llama_server(name, binary, args.port + 1 + i, max(args.concurrency)))
    try:
        for server in servers:
            server.proc = subprocess.Popen(server.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for server in servers:
            wait_ready(server.url, server.proc)
        for c in args.concurrency:
            for i in range(args.repeats):
                for server in servers:  # the same prompts for every server in a repeat
                    server.runs.setdefault(c, []).append(bench(lmserve, server.url, c, seed=c + 1000 * i))
    finally:
        for server in servers:
            if server.proc is not None:
                server.proc.terminate()
                server.proc.wait(30)
    report(servers, args)


def report(servers: list[Server], args: argparse.Namespace) -> None:
    print(f"\nbuilt-in model, {PROMPT_TOKENS} prompt + {OUTPUT_TOKENS} output tokens per request; "
          f"medians of {args.repeats} run(s); {cpu_name()}")
    ours, peers = servers[0], servers[1:]
    print(f"{'concurrency':>11} {'server':>22} {'output tok/s':>13} {'median TTFT ms':>15} "
          f"{'median TPOT ms':>15}" + "".join(f" {'x ' + p.name:>18}" for p in peers))
    for c in args.concurrency:
        for server in servers:
            tput = server.median(c, "output_throughput")
            ratios = "".join(f" {tput / p.median(c, 'output_throughput'):18.2f}" for p in peers) \
                if server is ours else ""
            print(f"{c:11d} {server.name:>22} {tput:13.1f} {server.median(c, 'median_ttft_ms'):15.0f} "
                  f"{server.median(c, 'median_tpot_ms'):15.1f}{ratios}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for server in servers:
            ax.plot(args.concurrency, [server.median(c, "output_throughput") for c in args.concurrency],
                    "o-", label=server.name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"built-in model, {cpu_name()}", fontsize=10)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()

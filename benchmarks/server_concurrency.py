"""`lmserve serve` under `lmserve bench` at several concurrencies: output tokens/s and TTFT.

Starts the server on the built-in model (mode=server), then for each concurrency C sends
max(64, 2C) random requests of 261 prompt and 128 output tokens (end-of-sequence ignored), at
most C in flight, as the issue's llama.cpp measurement did (its own server, 16 slots,
concurrency 16: about 95 output tokens/s, median TTFT about 7 s; quoted, not re-measured:
llama-cpp-python has no batched server). Prints the table with the ratio to that figure and
draws output tokens/s against concurrency.

    .venv/bin/python benchmarks/server_concurrency.py [--concurrency 1 4 16 64] [--repeats 3] [--plot FILE.png]
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

LLAMA_CPP_C16_TOKS = 95.0  # the llama-server figure at concurrency 16


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
                        "--num-prompts", str(num_prompts or max(64, 2 * concurrency)), "--random-input-len", "261",
                        "--random-output-len", "128", "--random-range-ratio", "0",
                        "--ignore-eos", "--max-concurrency", str(concurrency), "--no-progress",
                        # new prompts for every run: the prefix cache must not serve them
                        "--seed", str(seed),
                        "--result-file", result_file], check=True, stdout=subprocess.DEVNULL)
        with open(result_file) as f:
            return json.load(f)
    finally:
        os.unlink(result_file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--opt", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per concurrency (new prompts each); the table shows their medians and range")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    lmserve = [sys.executable, "-m", "lmserve.cli"]
    serve = [*lmserve, "serve", "--port", str(args.port), "--mode", "server"]
    if args.opt:
        serve += ["--opt", args.opt]
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        wait_ready(url, proc)
        for c in args.concurrency:
            runs = [bench(lmserve, url, c, seed=c + 1000 * i) for i in range(args.repeats)]
            rows.append((c, *(statistics.median(r[k] for r in runs)
                              for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")),
                         [r["output_throughput"] for r in runs]))
    finally:
        proc.terminate()
        proc.wait(30)

    print(f"\nlmserve serve (built-in model, mode=server, opt={args.opt or 'default'}); "
          f"261 prompt + 128 output tokens per request"
          + (f"; medians of {args.repeats} runs" if args.repeats > 1 else ""))
    print(f"{'concurrency':>11} {'output tok/s':>13} {'x llama.cpp c16':>16} {'median TTFT ms':>15} "
          f"{'median TPOT ms':>15}" + ("  runs (output tok/s)" if args.repeats > 1 else ""))
    for c, tput, ttft, tpot, each in rows:
        print(f"{c:11d} {tput:13.1f} {tput / LLAMA_CPP_C16_TOKS:16.2f} {ttft:15.0f} {tpot:15.1f}"
              + ("  " + " ".join(f"{t:.1f}" for t in each) if args.repeats > 1 else ""))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r[0] for r in rows], [r[1] for r in rows], "o-", label="lmserve")
        ax.axhline(LLAMA_CPP_C16_TOKS, color="gray", ls="--", label="llama.cpp server, c=16 (issue)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()

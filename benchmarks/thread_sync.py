"""One-stream decode after the main thread ran one multithreaded torch operation, with lmserve
imported before torch (libgomp's spinning set, lmserve/openmp.py) and after it (libgomp's
defaults), and with no torch work in the main thread as the reference.

Each run is a fresh interpreter (libgomp reads its settings once, when it loads): an
engine at ``--opt`` decodes ``--tokens`` tokens greedily after a short prompt, and the engine
thread's empty OpenMP region is timed (engine/thread_check.py). Runs alternate between the three
cases, ``--rounds`` times; medians.

    .venv/bin/python benchmarks/thread_sync.py [--opt O3] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from lmserve.kernels.build import cpu_name
from lmserve.openmp import SETTINGS

RUN = """
import json, time
{imports}
from lmserve import Engine
from lmserve.engine.thread_check import parallel_region_seconds
{torch_work}
engine = Engine(opt={opt!r}, max_num_sequence=1, verbose=False)
engine.completions.create(prompt="warm up", max_tokens=4, temperature=0)
start = time.perf_counter()
out = engine.completions.create(prompt="Once upon a time", max_tokens={tokens}, temperature=0,
                                ignore_eos=True)
rate = out.usage.completion_tokens / (time.perf_counter() - start)
region = engine._loop.call(lambda: parallel_region_seconds(torch.get_num_threads()))
engine.shutdown()
print(json.dumps({{"rate": rate, "region_us": region * 1e6}}))
"""
CASES = {
    "no torch work in the main thread": ("import lmserve\nimport torch", ""),
    "torch work, lmserve imported first": ("import lmserve\nimport torch", "(torch.randn(1000, 1000) * 2).sum()"),
    "torch work, torch imported first": ("import torch", "(torch.randn(1000, 1000) * 2).sum()"),
}


def run(case: str, opt: str, tokens: int) -> dict:
    imports, torch_work = CASES[case]
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    code = RUN.format(imports=imports, torch_work=torch_work, opt=opt, tokens=tokens)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt", default="O3")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results: dict = {case: [] for case in CASES}
    for r in range(args.rounds):
        order = list(CASES)[r % len(CASES):] + list(CASES)[:r % len(CASES)]
        for case in order:
            results[case].append(run(case, args.opt, args.tokens))
    print(f"CPU: {cpu_name()}; "
          f"opt {args.opt}, one stream, {args.tokens} tokens; median of {args.rounds} rounds")
    base = statistics.median(r["rate"] for r in results[list(CASES)[0]])
    for case, runs in results.items():
        rate = statistics.median(r["rate"] for r in runs)
        region = statistics.median(r["region_us"] for r in runs)
        print(f"{case:40s} {rate:7.1f} tok/s ({rate / base:.2f}x)  empty region {region:5.1f} us")


if __name__ == "__main__":
    main()

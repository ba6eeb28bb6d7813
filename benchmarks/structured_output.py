"""What structured output costs: output tokens/s at concurrency 16 with a JSON schema on every
request against the same load unconstrained, and the grammar compile time of a typical schema.

Starts ``lmserve serve`` on the built-in model (mode=server) and runs ``lmserve bench`` rounds:
each round runs the ``random`` dataset and the ``json-schema`` dataset (the same prompts, each
request asking for ``lmserve.bench.datasets.BENCH_SCHEMA`` through ``response_format``) back to
back, alternating which goes first, with new prompts every round (the prefix cache must not
serve them); the ratio is taken within each round and the median reported (this machine's speed
changes between stretches of seconds). 261 prompt and 128 output tokens per request,
end-of-sequence ignored (a constrained answer still ends when its grammar is complete; tokens/s
counts what was generated). Then compiles schemas in this process: the token table (once per
engine), a schema cold, the same schema again (xgrammar's cache).

    .venv/bin/python benchmarks/structured_output.py [--rounds 3] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from server_concurrency import bench, wait_ready


def compile_times() -> list[tuple[str, float]]:
    """(what, milliseconds) for the compile steps of the built-in model's tokenizer."""
    from lmserve.bench.datasets import BENCH_SCHEMA
    from lmserve.structured.compiler import GrammarCompiler
    from lmserve.structured.params import StructuredOutputsParams
    from lmserve.tokenizer import Tokenizer

    compiler = GrammarCompiler(Tokenizer.from_model(None), 49152)
    rows = []
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json_object=True))
    rows.append(("token table + first grammar (once per engine)", time.perf_counter() - start))
    schema = StructuredOutputsParams(json=BENCH_SCHEMA)
    for what in ("the benchmark schema, cold", "the same schema again (cached)"):
        start = time.perf_counter()
        compiler.compile(schema)
        rows.append((what, time.perf_counter() - start))
    return [(what, seconds * 1000) for what, seconds in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=8432)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    lmserve = [sys.executable, "-m", "lmserve.cli"]
    proc = subprocess.Popen([*lmserve, "serve", "--port", str(args.port), "--mode", "server"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[float]] = {"random": [], "json-schema": []}
    try:
        wait_ready(url, proc)
        for r in range(args.rounds):
            order = ["random", "json-schema"] if r % 2 == 0 else ["json-schema", "random"]
            for dataset in order:
                result = bench(lmserve, url, args.concurrency, seed=7000 + r, dataset=dataset)
                runs[dataset].append(result["output_throughput"])
    finally:
        proc.terminate()
        proc.wait(30)
    ratios = [c / u for c, u in zip(runs["json-schema"], runs["random"])]
    print(f"\nlmserve serve (built-in model, mode=server), concurrency {args.concurrency}, "
          f"261 prompt + 128 output tokens per request; {args.rounds} rounds")
    print(f"{'':>22} {'output tok/s (median)':>22}  runs")
    for name, label in (("random", "unconstrained"), ("json-schema", "JSON schema")):
        print(f"{label:>22} {statistics.median(runs[name]):22.1f}  "
              + " ".join(f"{t:.1f}" for t in runs[name]))
    print(f"{'constrained / plain':>22} {statistics.median(ratios):22.3f}  "
          + " ".join(f"{x:.3f}" for x in ratios))
    print("\ngrammar compile time (built-in model's tokenizer, 49,152 tokens)")
    for what, ms in compile_times():
        print(f"  {what:<48} {ms:9.2f} ms")


if __name__ == "__main__":
    main()

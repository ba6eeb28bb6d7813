"""What structured output costs: output tokens/s at concurrency 16 with a JSON schema on every
request against the same load unconstrained, and the grammar compile time of a typical schema.

Starts ``lmserve serve`` on the built-in model (mode=server) and runs ``lmserve bench`` rounds:
each round runs the ``random`` dataset and the ``json-schema`` dataset (random prompts of the same lengths, each
request asking for ``lmserve.bench.datasets.BENCH_SCHEMA`` through ``response_format``) back to
back, alternating which goes first, with new prompts for every run (the prefix cache must not
serve them); the ratio is taken within each round and the median reported (this machine's speed
changes by up to 2x between stretches of seconds, so runs are short and many). 2C requests of
261 prompt and 128 output tokens, end-of-sequence ignored (a constrained answer still ends when
its grammar is complete; tokens/s counts what was generated, and the median time per output token
after the first, TPOT, is compared too). Then compiles schemas in this process: the token table (once per
engine), a schema cold, the same schema again (xgrammar's cache).

    .venv/bin/python benchmarks/structured_output.py [--rounds 10] [--concurrency 16]
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
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=8432)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    lmserve = [sys.executable, "-m", "lmserve.cli"]
    proc = subprocess.Popen([*lmserve, "serve", "--port", str(args.port), "--mode", "server"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {"random": [], "json-schema": []}
    try:
        wait_ready(url, proc)
        for r in range(args.rounds):
            order = ["random", "json-schema"] if r % 2 == 0 else ["json-schema", "random"]
            for i, dataset in enumerate(order):
                # New prompts for every run: the prefix cache would spare the second its prefill.
                runs[dataset].append(bench(lmserve, url, args.concurrency, seed=7000 + 2 * r + i,
                                           dataset=dataset, num_prompts=2 * args.concurrency))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"\nlmserve serve (built-in model, mode=server), concurrency {args.concurrency}, "
          f"{2 * args.concurrency} requests of 261 prompt + 128 output tokens; {args.rounds} rounds")
    print(f"{'':>22} {'output tok/s':>13} {'median TPOT ms':>15} {'output tokens':>14}  (medians)")
    for name, label in (("random", "unconstrained"), ("json-schema", "JSON schema")):
        print(f"{label:>22} " + " ".join(f"{statistics.median(r[k] for r in runs[name]):{w}.1f}" for k, w in
                                         (("output_throughput", 13), ("median_tpot_ms", 15),
                                          ("total_output_tokens", 14))))
    for key, label in (("output_throughput", "output tok/s"), ("median_tpot_ms", "TPOT")):
        ratios = [c[key] / u[key] for c, u in zip(runs["json-schema"], runs["random"])]
        print(f"{'constrained / plain':>22} {label:>13}: median {statistics.median(ratios):.3f}, rounds "
              + " ".join(f"{x:.2f}" for x in ratios))
    print("\ngrammar compile time (built-in model's tokenizer, 49,152 tokens)")
    for what, ms in compile_times():
        print(f"  {what:<48} {ms:9.2f} ms")


if __name__ == "__main__":
    main()

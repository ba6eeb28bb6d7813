"""Tensor parallelism on one host: what communication costs a step, against one process.

For each layout (one process; ``--tp`` ranks meeting in shared memory; the same over gloo, as
ranks on several hosts do: ``LMSERVE_TRANSPORT=gloo``), in fresh processes, rounds
interleaved, at the default level on a GGUF Q4_1 model:

- one-stream decode: a 32-token prompt, 64 greedy tokens, tokens/s after the first;
- c=16: sixteen such requests together, output tokens/s over the whole run.

For the parallel layouts it also reads rank 0's clocks: time in all-reduces (two a layer,
waiting for the other ranks included) and time handing each step to the other ranks, per
decode step and as a share of the step. The issue's goal: under 15% of a decode step at TP=2.

The default model is random, with the built-in model's vocabulary, depth and MLP but 8 heads
and 4 KV heads (hidden 512), since the built-in model's 9 heads split only 3 ways; ``--model``
takes any GGUF. This machine has 2 cores: TP=2 gives each rank one, so speed-up is not the
claim (one process uses both cores for every matmul already).

    .venv/bin/python benchmarks/parallel.py [--tp 2] [--rounds 3] [--model M.gguf]
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

from lmserve.kernels.build import cpu_name

PROMPT = list(range(1000, 1032))
NEW_TOKENS = 64


def measure(model: str, tp: int, pp: int) -> dict:
    """One layout's numbers, in this process."""
    from lmserve.config import EngineConfig
    from lmserve.engine.core import EngineCore
    from lmserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=model, tensor_parallel_shards=tp, pipeline_parallel_stages=pp,
                                   mode="server", max_num_sequence=16, verbose=False))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    group = core.group

    def clocks() -> tuple[float, float, float]:
        if group is None:
            return 0.0, 0.0, 0.0
        reduce = group.all_reduce.seconds() if group.all_reduce else 0.0
        return reduce, group.send_seconds, group.channel_seconds()

    def generate(n: int) -> tuple[float, float, int, tuple[float, float]]:
        """(seconds of the whole run, of its steps after the first (the prompts' prefill:
        decode steps when n = 1), their count, rank 0's clocks over them)."""
        for i in range(n):
            core.add_request(f"{n}-{i}-{time.monotonic()}", PROMPT, params)
        start = time.perf_counter()
        core.step()
        before, decode_start, steps = clocks(), time.perf_counter(), 0
        while core.has_work():
            core.step()
            steps += 1
        end = time.perf_counter()
        spent = tuple(a - b for a, b in zip(clocks(), before))
        return end - start, end - decode_start, steps, spent

    generate(1)  # warm-up
    _, decode_s, steps, (reduce_s, send_s, channel_s) = generate(1)
    total_s, _, _, _ = generate(16)
    core.close()
    return {"decode_tok_s": steps / decode_s, "c16_tok_s": 16 * NEW_TOKENS / total_s,
            "step_ms": 1e3 * decode_s / steps, "all_reduce_ms": 1e3 * reduce_s / steps,
            "send_ms": 1e3 * send_s / steps, "channel_ms": 1e3 * channel_s / steps}


def default_model(directory: str) -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from tiny_models import make_gguf_llama

    path = os.path.join(directory, "tp-bench-q4_1.gguf")
    if not os.path.exists(path):
        make_gguf_llama(path, "Q4_1", num_layers=30, hidden_size=512, intermediate_size=1536,
                        num_heads=8, num_kv_heads=4, vocab_size=49152, seed=0)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="a GGUF file (default: a random model, see above)")
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)  # a child: tp, pp
    args = parser.parse_args()
    model = args.model or default_model(tempfile.gettempdir())
    if args.one is not None:
        print(json.dumps(measure(model, *args.one)))
        return
    layouts = {"one process": (1, 1, "shm")}
    for transport in ("shm", "gloo"):
        layouts[f"TP={args.tp} {transport}"] = (args.tp, 1, transport)
        layouts[f"PP={args.pp} {transport}"] = (1, args.pp, transport)
    results: dict[str, list[dict]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, (tp, pp, transport) in layouts.items():
            out = subprocess.run([sys.executable, __file__, "--one", str(tp), str(pp), "--model", model],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "LMSERVE_TRANSPORT": transport})
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
    print(f"{os.path.basename(model)}, default level, {cpu_name()}; "
          f"medians of {args.rounds} interleaved rounds; per one-stream decode step, rank 0's "
          f"time in all-reduces, handing out the step, and its pipeline channels")
    print(f"{'layout':<12} {'decode tok/s':>12} {'c=16 tok/s':>11} {'step ms':>8} "
          f"{'all-reduce ms':>13} {'send ms':>8} {'channel ms':>10} {'comm share':>10}")
    for name, m in med.items():
        comm = m["all_reduce_ms"] + m["send_ms"] + m["channel_ms"]
        print(f"{name:<12} {m['decode_tok_s']:>12.1f} {m['c16_tok_s']:>11.1f} "
              f"{m['step_ms']:>8.2f} {m['all_reduce_ms']:>13.2f} {m['send_ms']:>8.2f} "
              f"{m['channel_ms']:>10.2f} {100 * comm / m['step_ms']:>9.1f}%")
    one = med["one process"]
    for name in list(med)[1:]:
        par = med[name]
        print(f"{name} / one process: decode {par['decode_tok_s'] / one['decode_tok_s']:.2f}x, "
              f"c=16 {par['c16_tok_s'] / one['c16_tok_s']:.2f}x")


if __name__ == "__main__":
    main()

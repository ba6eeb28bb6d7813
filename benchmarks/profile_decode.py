"""Where a step spends its time, by component: one decode stream, or a server-like load.

Wraps the model's pieces (the decoder layers' call list, the head, the whole step) with
wall-clock timers on the engine thread and prints milliseconds per step. Kernels are C++ calls,
invisible to torch.profiler, hence timers. With ``--split-layers`` the layers run call by call
from Python, as they do without the call list, so each matmul shape and the attention are timed
apart (each time includes that call's Python overhead, which the call list does not pay).

By default one stream generates ``--tokens`` tokens greedily after a short prompt. With
``--concurrency C``, ``--requests`` random prompts of ``--prompt-len`` tokens are served by
mode=server with at most C in flight (threads calling ``Engine.generate``), as
benchmarks/server_concurrency.py loads the HTTP server, and each part's share of the time is
printed too.

    .venv/bin/python benchmarks/profile_decode.py [--opt O2] [--tokens 128] [--split-layers]
    .venv/bin/python benchmarks/profile_decode.py --concurrency 16 --requests 64 --prompt-len 261
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import threading
import time

from lmserve import Engine, SamplingParams
from lmserve.attention.base import AttentionBackend
from lmserve.engine.core import EngineCore
from lmserve.layers import linear
from lmserve.models.llama import LayerCalls, LlamaModel

totals: collections.Counter = collections.Counter()


def timed(cls, method: str, label) -> None:
    inner = getattr(cls, method)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            totals[label(self)] += time.perf_counter() - start

    setattr(cls, method, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt", default="O2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=0, help="0: one stream, no server load")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=261)
    ap.add_argument("--split-layers", action="store_true",
                    help="run the layers call by call from Python to time each kernel")
    args = ap.parse_args()

    timed(linear.BlockLinear, "__call__", lambda s: f"matmul {s.n}x{s.k} ({s.bits}-bit)")
    timed(linear.DenseLinear, "__call__", lambda s: f"matmul {tuple(s.weight.shape)} (dense)")
    timed(EngineCore, "step", lambda s: "step (total)")
    timed(LlamaModel, "forward", lambda s: "model forward")
    timed(LlamaModel, "logits", lambda s: "head (logits)")
    timed(LayerCalls, "run", lambda s: "decoder layers (one C++ call list)")
    engine = Engine(opt=args.opt, verbose=False, **({"mode": "server"} if args.concurrency else {}))
    if args.split_layers:
        engine._core.runner.layer_calls = None
    timed(type(engine._core.runner.backend), "forward", lambda s: "attention (rope+store+attend)")
    assert issubclass(type(engine._core.runner.backend), AttentionBackend)

    vocab = str(engine._core.args.vocab_size)  # the head's matmul runs in logits, not forward
    engine.completions.create(prompt="warm up", max_tokens=4, temperature=0)
    totals.clear()
    start = time.perf_counter()
    if args.concurrency:
        serve_load(engine, args)
        wall = time.perf_counter() - start
        steps = engine.stats().steps
    else:
        out = engine.completions.create(prompt="Once upon a time", max_tokens=args.tokens,
                                        temperature=0, ignore_eos=True)
        wall = time.perf_counter() - start
        steps = out.usage.completion_tokens
        print(f"opt={args.opt}: {steps} tokens in {wall:.2f} s = {steps / wall:.1f} tok/s "
              f"({1e3 * wall / steps:.2f} ms a token; the first step also prefills the prompt)")
    engine.shutdown()
    inside_forward = sum(v for k, v in totals.items() if k.startswith(("attention", "decoder layers"))
                         or (k.startswith("matmul") and vocab not in k))
    rest = totals["model forward"] - inside_forward
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    rows.append(("rest of the forward (embedding, final norm"
                 + ("; layers' norms, SiLU)" if args.split_layers else ")"), rest))
    for name, seconds in rows:
        share = f"  {100 * seconds / totals['step (total)']:5.1f}%" if args.concurrency else ""
        print(f"  {name:52} {1e3 * seconds / steps:7.3f} ms/step{share}")


def serve_load(engine: Engine, args) -> None:
    """--requests random prompts, 128 greedy tokens each, at most --concurrency in flight."""
    rng = random.Random(0)
    vocab = engine._core.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                if not prompts:
                    return
                prompt = prompts.pop()
            sent, first = time.perf_counter(), None
            for _ in engine.generate(prompt, params):
                first = first or time.perf_counter() - sent
            ttft.append(first)

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    s = engine.stats()
    print(f"opt={args.opt}: {args.requests} requests of {args.prompt_len} + {args.tokens} tokens, "
          f"at most {args.concurrency} in flight: {args.requests * args.tokens / wall:.1f} output tok/s, "
          f"median TTFT {1e3 * statistics.median(ttft):.0f} ms, {s.steps} steps in {wall:.1f} s")


if __name__ == "__main__":
    main()

"""Where one decode step of a single stream spends its time, by component.

Wraps the model's pieces (each linear layer by shape, the attention call, the head, the whole
step) with wall-clock timers on the engine thread, generates ``--tokens`` tokens greedily, and
prints milliseconds per step. Kernels are C++ calls, invisible to torch.profiler, hence timers.

    .venv/bin/python benchmarks/profile_decode.py [--opt O2] [--tokens 128]
"""

from __future__ import annotations

import argparse
import collections
import time

from lmserve import Engine
from lmserve.attention.base import AttentionBackend
from lmserve.engine.core import EngineCore
from lmserve.layers import linear
from lmserve.models.llama import LlamaModel

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
    args = ap.parse_args()

    timed(linear.BlockLinear, "__call__", lambda s: f"matmul {s.n}x{s.k} ({s.bits}-bit)")
    timed(linear.DenseLinear, "__call__", lambda s: f"matmul {tuple(s.weight.shape)} (dense)")
    timed(EngineCore, "step", lambda s: "step (total)")
    timed(LlamaModel, "forward", lambda s: "model forward")
    timed(LlamaModel, "logits", lambda s: "head (logits)")
    engine = Engine(opt=args.opt, verbose=False)
    timed(type(engine._core.runner.backend), "forward", lambda s: "attention (rope+store+attend)")
    assert issubclass(type(engine._core.runner.backend), AttentionBackend)

    vocab = str(engine._core.args.vocab_size)  # the head's matmul runs in logits, not forward
    engine.completions.create(prompt="warm up", max_tokens=4, temperature=0)
    totals.clear()
    start = time.perf_counter()
    out = engine.completions.create(prompt="Once upon a time", max_tokens=args.tokens,
                                    temperature=0, ignore_eos=True)
    wall = time.perf_counter() - start
    engine.shutdown()
    steps = out.usage.completion_tokens
    print(f"opt={args.opt}: {steps} tokens in {wall:.2f} s = {steps / wall:.1f} tok/s "
          f"({1e3 * wall / steps:.2f} ms a token; the first step also prefills the prompt)")
    inside_forward = sum(v for k, v in totals.items()
                         if k.startswith("attention") or (k.startswith("matmul") and vocab not in k))
    layer_ops = totals["model forward"] - inside_forward
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    rows.append(("other layer ops (norms, SiLU, residual, embedding)", layer_ops))
    for name, seconds in rows:
        print(f"  {name:52} {1e3 * seconds / steps:7.3f} ms/step")


if __name__ == "__main__":
    main()

"""Does an opt level lose quality? Perplexity on a fixed text and greedy agreement with O0.

Perplexity is computed by the engine's own model, runner and KV cache on the engine thread (one
prefill of each window of the text, every position scored), so it covers the same weights,
kernels and attention the level serves with. Greedy agreement: the chat prompts of the test
suite plus the first sentences of the text as prompts, 64 greedy tokens each, compared with O0.

    .venv/bin/python benchmarks/quality.py [--opt O1 --opt O2 --opt O3]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from lmserve import Engine
from lmserve.attention.base import AttentionInput
from lmserve.models.llama import ForwardContext

TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity_text.txt")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from prompts import CHAT_PROMPTS  # noqa: E402


def perplexity(engine: Engine, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) of ``ids`` scored in non-overlapping windows."""

    def score() -> tuple[float, int]:
        core = engine._core
        runner, pool = core.runner, core.pool
        nll, count = 0.0, 0
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window + 1]
            inputs, targets = chunk[:-1], torch.tensor(chunk[1:])
            pages = pool.alloc(-(-len(inputs) // runner.kv.page_size))
            try:
                inp = AttentionInput([len(inputs)], [len(inputs)], [pages])
                meta = runner.backend.prepare(inp, runner.kv.page_size, runner.device)
                cos, sin = runner.rotary.lookup(torch.arange(len(inputs)))
                ctx = ForwardContext(runner.backend, meta, runner.ops, cos, sin, runner.kv)
                hidden = runner.model.forward(torch.tensor(inputs), ctx)
                logp = runner.model.logits(hidden).log_softmax(-1)
                nll -= logp.gather(1, targets[:, None]).sum().item()
                count += len(targets)
            finally:
                pool.release(pages)
        return nll, count

    nll, count = engine._loop.call(score, timeout=600)
    return math.exp(nll / count)


def greedy(engine: Engine, prompts: list[str], tokens: int) -> list[str]:
    out = []
    for p in prompts:
        r = engine.chat.completions.create(messages=[{"role": "user", "content": p}],
                                           max_tokens=tokens, temperature=0)
        out.append(r.choices[0].message.content)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt", action="append", help="levels to compare with O0 (default O1 O2 O3)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    text = open(TEXT, encoding="utf-8").read()
    sentences = [s.strip() + "." for s in text.split(".") if len(s.strip()) > 40][:13]
    prompts = CHAT_PROMPTS + sentences

    results = {}
    for opt in ["O0", *(args.opt or ["O1", "O2", "O3"])]:
        engine = Engine(opt=opt, prefix_cache_mode="disable", verbose=False)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        results[opt] = (perplexity(engine, ids, args.window), greedy(engine, prompts, args.tokens))
        engine.shutdown()

    ref_ppl, ref_out = results["O0"]
    print(f"\nperplexity of {TEXT} ({len(ids)} tokens, windows of {args.window}); "
          f"greedy: {len(prompts)} prompts x {args.tokens} tokens")
    print(f"{'opt':5} {'perplexity':>11} {'vs O0':>8} {'greedy = O0':>12}")
    for opt, (ppl, out) in results.items():
        same = sum(a == b for a, b in zip(out, ref_out))
        print(f"{opt:5} {ppl:11.4f} {100 * (ppl / ref_ppl - 1):+7.2f}% {same:>5}/{len(prompts)}")


if __name__ == "__main__":
    main()

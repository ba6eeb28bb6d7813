"""How much does an opt level lose against O0? Measured as llama.cpp measures quantization.

As ``llama-perplexity --kl-divergence`` does, each level reads a fixed text teacher-forced
(``benchmarks/data/perplexity_text.txt``, in windows of ``--window`` tokens), and its
distribution at every position is compared with O0's at the same position:

- perplexity, and its change against O0's (bar: within 1%);
- mean KL divergence KL(O0 || level) per token (bar: at most 0.005);
- top-1 agreement: positions where the level's most likely token is O0's (bar: at least 98%).

Everything goes through the engine's public API, as an evaluation tool would use it: the
windows are sent together as requests with ``prompt_logprobs=20, max_tokens=0`` (the Python
API's form of ``/v1/completions`` with ``echo`` and ``logprobs``). The KL is computed over the
tokens O0 reports among its 20 most likely that the level reports too (the level's own top 20
and the text's token), plus one bucket for the rest of the vocabulary: a lower bound of the
full-vocabulary KL, equal to it when the two distributions agree in shape outside those tokens.

Greedy agreement is reported too, not as a bar (greedy continuations part at the first near
tie): the chat prompts of the test suite plus the first sentences of the text, 64 tokens each.

    .venv/bin/python benchmarks/quality.py [--opt O1 --opt O2 --opt O3] [--window 512]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from lmserve import Engine, SamplingParams
from lmserve.outputs import TokenLogprob

TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity_text.txt")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from prompts import CHAT_PROMPTS  # noqa: E402

TOP = 20  # alternatives per position (OpenAI's and vLLM's limit)
BAR_PPL, BAR_KL, BAR_TOP1 = 0.01, 0.005, 0.98


@dataclass
class Quality:
    ppl: float
    kl: float  # mean per token, against O0
    top1: float  # share of positions with O0's most likely token
    greedy_same: int  # prompts whose greedy continuation equals O0's

    def meets_bar(self, ref_ppl: float) -> bool:
        return abs(self.ppl / ref_ppl - 1) <= BAR_PPL and self.kl <= BAR_KL and self.top1 >= BAR_TOP1


def score_windows(engine: Engine, ids: list[int], window: int) -> list[TokenLogprob]:
    """Every scored position of the text (each window's tokens after its first), in order."""
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    results: list = [None] * len(windows)
    params = SamplingParams(max_tokens=0, prompt_logprobs=TOP)

    def one(i: int) -> None:
        results[i] = next(iter(engine.generate(windows[i], params))).prompt_logprobs[1:]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(windows))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [lp for r in results for lp in r]


def kl_divergence(p: TokenLogprob, q: TokenLogprob) -> float:
    """KL(p || q) over p's reported tokens that q reports too, and the rest as one bucket."""
    q_known = dict(q.top)
    q_known[q.token_id] = q.logprob
    p_known = dict(p.top)
    p_known[p.token_id] = p.logprob
    shared = [t for t in p_known if t in q_known]
    kl = sum(math.exp(p_known[t]) * (p_known[t] - q_known[t]) for t in shared)
    p_rest = max(1.0 - sum(math.exp(p_known[t]) for t in shared), 1e-12)
    q_rest = max(1.0 - sum(math.exp(q_known[t]) for t in shared), 1e-12)
    return max(kl + p_rest * math.log(p_rest / q_rest), 0.0)


def greedy(engine: Engine, prompts: list[str], tokens: int) -> list[str]:
    def one(p: str) -> str:
        r = engine.chat.completions.create(messages=[{"role": "user", "content": p}],
                                           max_tokens=tokens, temperature=0)
        return r.choices[0].message.content

    out: list = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, one(prompts[i])))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt", action="append", help="levels to compare with O0 (default O1 O2 O3)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    text = open(TEXT, encoding="utf-8").read()
    sentences = [s.strip() + "." for s in text.split(".") if len(s.strip()) > 40][: 20 - len(CHAT_PROMPTS)]
    prompts = CHAT_PROMPTS + sentences

    scored, outputs = {}, {}
    for opt in ["O0", *(args.opt or ["O1", "O2", "O3"])]:
        engine = Engine(opt=opt, max_num_sequence=8, verbose=False)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        scored[opt] = score_windows(engine, ids, args.window)
        outputs[opt] = greedy(engine, prompts, args.tokens)
        engine.shutdown()

    ref = scored["O0"]
    ref_ppl = math.exp(-sum(lp.logprob for lp in ref) / len(ref))
    results = {}
    for opt, lps in scored.items():
        results[opt] = Quality(
            ppl=math.exp(-sum(lp.logprob for lp in lps) / len(lps)),
            kl=sum(kl_divergence(p, q) for p, q in zip(ref, lps)) / len(lps),
            top1=sum(p.top[0][0] == q.top[0][0] for p, q in zip(ref, lps)) / len(lps),
            greedy_same=sum(a == b for a, b in zip(outputs[opt], outputs["O0"])))

    print(f"\n{cpu_name()}; {TEXT}: {len(ref)} positions scored in windows of {args.window}; "
          f"greedy: {len(prompts)} prompts x {args.tokens} tokens")
    print(f"bar: perplexity within {BAR_PPL:.0%} of O0, mean KL <= {BAR_KL}, top-1 = O0 at >= {BAR_TOP1:.0%}")
    print(f"{'opt':40} {'perplexity':>10} {'vs O0':>8} {'mean KL':>9} {'top-1 = O0':>10} "
          f"{'greedy = O0':>11}  bar")
    for opt, q in results.items():
        print(f"{opt:40} {q.ppl:10.4f} {100 * (q.ppl / ref_ppl - 1):+7.2f}% {q.kl:9.5f} "
              f"{100 * q.top1:9.2f}% {q.greedy_same:>7}/{len(prompts)}  "
              f"{'meets' if q.meets_bar(ref_ppl) else 'misses'}")


if __name__ == "__main__":
    main()

"""Where a draft model disagrees with its target: agreement by the draft's margin (its best
token's logit over its second best), and what ending a chain after a near tie would do.

The target (``--opt``, default O0) answers the speculative benchmark's prompts greedily (64
tokens, past the end of each answer as that benchmark does); the draft (the built-in model at
``--draft-opt``, default O3: the target's own weights, rounded) then scores each answer
teacher-forced (``prompt_logprobs``): what it drafts there while the drafts before are accepted
(up to the rounding of its KV, which a prefill writes as decoding does, in another order). Prints, per margin
band, the share of positions, how often the draft's best
token is the target's, and how often the target's is among the draft's two best. Then replays
chains of ``k`` drafts that end after the first draft with a margin under each threshold (``-``:
never), on the recorded answers, with a step's cost from times measured in the same run (a draft
pass of one token, the target's pass at 1..k+1 tokens), and prints tokens per step and the
replayed speed over plain decoding. The replay leaves out what the engine does besides the
passes (sampling, scheduling; a drafted step's catch-up of two tokens), and after a rejected
draft it runs the chain on as the recorded margins say: a guide to the rule's threshold, not a
measure of speed (benchmarks/speculative.py is).

    .venv/bin/python benchmarks/draft_ties.py [--draft-opt O3] [--lengths 6 8 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

from speculative import CHAT, grounded_prompts

from lmserve import Engine, SamplingParams
from lmserve.kernels.build import cpu_name
from lmserve.models.builtin import builtin_model_path
from lmserve.step import SeqStep, StepInput

BANDS = [0, 0.05, 0.1, 0.2, 0.4, 0.8, float("inf")]
THRESHOLDS = [None, 0.05, 0.1, 0.2, 0.4]


def answers(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [[t for o in engine.generate(p, params) for d in o.deltas for t in d.token_ids]
            for p in prompts]


def draft_view(engine: Engine, prompt: list[int],
               answer: list[int]) -> list[tuple[bool, float, bool]]:
    """Per answer token: (the draft's best token is it, the draft's margin there, it is among
    the draft's two best)."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)  # (as quality.py scores a text)
    scored = next(iter(engine.generate(prompt + answer, params))).prompt_logprobs
    view = []
    for token, entry in zip(answer, scored[len(prompt):]):
        (best, first), (runner_up, second) = entry.top[:2]
        view.append((best == token, first - second, token in (best, runner_up)))
    return view


def pass_ms(engine: Engine, prompt: list[int], tokens: int, reps: int = 15) -> float:
    """Median milliseconds of the model's forward pass over ``tokens`` tokens after ``prompt``,
    with every token's logits (a verify step of ``tokens - 1`` drafts). Run on the engine thread
    when no request is left: the pass writes KV into pages the prefix cache may hold, so the
    engine serves nothing after it."""
    assert engine.is_idle(), "a pass over pages the prefix cache may hold, with requests in flight"

    def run() -> float:
        page = engine.plan.page_size
        pages = list(range((len(prompt) + tokens + page - 1) // page))
        step = StepInput([SeqStep(start=len(prompt), token_ids=[1] * tokens, page_table=pages,
                                  num_logits=tokens)])
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            engine._core.runner.execute(step)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    return engine._loop.call(run, timeout=3600)


def replay(views: list[list[tuple[bool, float, bool]]], k: int, threshold: Optional[float],
           verify: list[float], draft: float) -> tuple[float, float]:
    """(tokens per step, milliseconds per token) of chains of at most ``k`` drafts that end
    after a margin under ``threshold`` (None: never)."""
    tokens = steps = ms = 0.0
    for view in views:
        i = 1  # (an answer's first token is the prefill's)
        while i < len(view):
            drafted = accepted = 0
            alive = True
            for agrees, margin, _ in view[i : i + k]:
                drafted += 1
                alive = alive and agrees
                accepted += alive
                if threshold is not None and margin < threshold:
                    break
            ms += verify[drafted] + drafted * draft
            gained = min(accepted + 1, len(view) - i)
            tokens, steps, i = tokens + gained, steps + 1, i + gained
    return tokens / steps, ms / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--opt", default="O0", help="the target's level")
    ap.add_argument("--draft-opt", default="O3")
    ap.add_argument("--lengths", type=int, nargs="+", default=[6, 8, 10],
                    help="fixed draft lengths to replay (no adaptive length here)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if min(args.lengths) < 1:
        ap.error("--lengths: draft lengths of at least 1")
    workloads = {"chat": CHAT, "grounded": grounded_prompts()}
    target = Engine(opt=args.opt, max_num_sequence=1, verbose=False)
    chat = {name: [target.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in texts] for name, texts in workloads.items()}
    recorded = {name: answers(target, prompts, args.max_tokens) for name, prompts in chat.items()}
    probe = chat["chat"][0]
    # verify[d]: the target's pass over d drafts and the newest token
    verify = [pass_ms(target, probe, d + 1) for d in range(max(args.lengths) + 1)]
    target.shutdown()
    draft = Engine(model=builtin_model_path(), opt=args.draft_opt, max_num_sequence=1,
                   verbose=False)
    views = {name: [draft_view(draft, p, a) for p, a in zip(chat[name], recorded[name])]
             for name in chat}
    draft_pass = pass_ms(draft, probe, 1)
    draft.shutdown()

    print(f"CPU: {cpu_name()}; target {args.opt}, draft the built-in model at {args.draft_opt}; "
          f"{args.max_tokens} tokens per answer")
    print(f"target pass at 1 / {max(args.lengths) + 1} tokens: {verify[0]:.1f} / "
          f"{verify[-1]:.1f} ms; draft pass of one token: {draft_pass:.2f} ms")
    for name, view in views.items():
        flat = [v for answer in view for v in answer]
        print(f"\n{name}: {len(flat)} positions, the draft's best token is the target's at "
              f"{sum(a for a, _, _ in flat) / len(flat):.1%}")
        print(f"{'margin':<14}{'positions':>10}{'agrees':>9}{'in top 2':>10}")
        for lo, hi in zip(BANDS, BANDS[1:]):
            band = [v for v in flat if lo <= v[1] < hi]
            if band:
                label = f"[{lo:g}, {hi:g})"
                print(f"{label:<14}{len(band) / len(flat):>10.1%}"
                      f"{sum(a for a, _, _ in band) / len(band):>9.1%}"
                      f"{sum(t for _, _, t in band) / len(band):>10.1%}")
        plain = verify[0]
        print(f"replayed: tokens a step, speed over plain decoding ({plain:.1f} ms a token)")
        print(f"{'ends after margin <':<22}" + "".join(f"{'k=' + str(k):>16}" for k in args.lengths))
        for threshold in THRESHOLDS:
            cells = []
            for k in args.lengths:
                per_step, ms = replay(view, k, threshold, verify, draft_pass)
                cells.append(f"{per_step:5.2f} {plain / ms:5.2f}x")
            label = "-" if threshold is None else f"{threshold:g}"
            print(f"{label:<22}" + "".join(f"{cell:>16}" for cell in cells))


if __name__ == "__main__":
    main()

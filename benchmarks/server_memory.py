"""Peak memory of a server-mode engine under full load, against the plan's budget.

Starts the built-in model with mode="server" at a given gpu_memory_utilization (on CPU: a
fraction of the machine's RAM), fills every batch slot with requests, and compares the process's
peak resident memory with the budget the plan promised to stay within.

    .venv/bin/python benchmarks/server_memory.py [--utilization 0.25] [--output-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

from lmserve import AsyncEngine, SamplingParams


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


async def full_load(engine: AsyncEngine, n: int, prompt_tokens: int, output_tokens: int) -> int:
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=output_tokens, ignore_eos=True)

    async def one(i: int) -> int:
        prompt = tok.encode(f"Request {i}: " + "tell me about the sea and the ships. " * 40)
        count = 0
        async for out in engine.generate(prompt[:prompt_tokens], params):
            count += sum(len(d.token_ids) for d in out.deltas)
        return count

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--utilization", type=float, default=0.25)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--output-tokens", type=int, default=128)
    args = ap.parse_args()

    engine = AsyncEngine(mode="server", gpu_memory_utilization=args.utilization, verbose=False)
    plan = engine.plan
    print(plan.describe())
    start = time.perf_counter()
    tokens = asyncio.run(full_load(engine, plan.max_num_sequence, args.prompt_tokens,
                                   args.output_tokens))
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    engine.shutdown()
    peak, budget = peak_rss_bytes(), plan.memory.budget
    print(f"{plan.max_num_sequence} concurrent requests, {tokens} tokens in {elapsed:.1f} s, "
          f"{stats.num_preemptions} preemptions")
    print(f"peak resident memory {peak / 2**30:.2f} GiB, plan expected {plan.memory.total / 2**30:.2f} "
          f"GiB, budget {budget / 2**30:.2f} GiB -> {'within' if peak <= budget else 'OVER'} "
          f"the budget ({peak / budget:.0%})")


if __name__ == "__main__":
    main()

"""Time to first token of a request whose 2000-token prefix is cached, against cold.

Three requests on the built-in model, one at a time: A (cold: nothing cached), then B, which
shares A's first ~2000 tokens and differs only in its last question, with the prefix cache on;
and B again on an engine with the cache disabled (cold). Prints both TTFTs and their ratio.

    .venv/bin/python benchmarks/prefix_cache_ttft.py [--prefix-tokens 2000] [--opt O2]
"""

from __future__ import annotations

import argparse
import time

from lmserve import Engine, SamplingParams

PARAGRAPH = ("The archive holds letters, ledgers and maps from the harbour's first century, "
             "each catalogued by year, sender and the ship that carried it. ")


def prompt_with_prefix(engine: Engine, prefix_tokens: int, question: str) -> list[int]:
    text = ""
    while len(engine.tokenizer.encode(text)) < prefix_tokens:
        text += PARAGRAPH
    return engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": text}, {"role": "user", "content": question}])


def ttft(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    for _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1)):
        break
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--opt", default=None)
    args = ap.parse_args()

    cached = Engine(opt=args.opt, verbose=False)
    a = prompt_with_prefix(cached, args.prefix_tokens, "Which ships are mentioned most?")
    b = prompt_with_prefix(cached, args.prefix_tokens, "Summarise the first decade.")
    ttft(cached, a[:32])  # warm-up
    cold_a = ttft(cached, a)
    before = cached.stats().prefix_cache_hit_tokens
    warm_b = ttft(cached, b)
    hits = cached.stats().prefix_cache_hit_tokens - before
    cached.shutdown()

    cold = Engine(opt=args.opt, verbose=False, prefix_cache_mode="disable")
    ttft(cold, b[:32])
    cold_b = ttft(cold, b)
    cold.shutdown()

    print(f"prompt tokens: A {len(a)}, B {len(b)}; B's tokens reused from A's KV: {hits}")
    print(f"TTFT A, cold              : {cold_a * 1e3:8.1f} ms")
    print(f"TTFT B, prefix cached     : {warm_b * 1e3:8.1f} ms")
    print(f"TTFT B, cache disabled    : {cold_b * 1e3:8.1f} ms")
    print(f"cached / cold: {warm_b / cold_b:.1%}")


if __name__ == "__main__":
    main()

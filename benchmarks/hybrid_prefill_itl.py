"""Inter-token latency of running streams while a long prompt arrives: hybrid against chunked.

8 streams decode on the built-in model; once they are all producing tokens, a request with a
~4000-token prompt arrives. With prefill_mode="hybrid" the streams' decode tokens ride along in
each prefill step; with "chunked" they wait for the prefill steps. Prints ITL p50/p99/max of the
8 streams over the window in which the long prompt was prefilled, for both modes.

    .venv/bin/python benchmarks/hybrid_prefill_itl.py [--chunk 512] [--long-tokens 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from lmserve import AsyncEngine, SamplingParams


async def measure(mode: str, chunk: int, long_tokens: int, opt) -> tuple[list[float], float]:
    engine = AsyncEngine(prefill_mode=mode, prefill_chunk_size=chunk, max_num_sequence=9,
                         max_total_sequence_length=16384, prefix_cache_mode="disable",
                         opt=opt, verbose=False)
    tok = engine.tokenizer
    short = [tok.apply_chat_template([{"role": "user", "content": f"Tell story number {i}."}])
             for i in range(8)]
    long_prompt = tok.encode("All work and no play makes a dull day. " * (long_tokens // 10))[:long_tokens]
    stream_params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stamps: list[list[float]] = [[] for _ in short]
    window: list[float] = []

    async def stream(i):
        async for _ in engine.generate(short[i], stream_params):
            stamps[i].append(time.perf_counter())

    async def long_request():
        while min(len(s) for s in stamps) < 5:  # every stream is decoding
            await asyncio.sleep(0.01)
        window.append(time.perf_counter())
        async for _ in engine.generate(long_prompt, SamplingParams(temperature=0, max_tokens=1)):
            window.append(time.perf_counter())  # the long prompt's prefill is done

    tasks = [asyncio.create_task(stream(i)) for i in range(8)]
    await long_request()
    await asyncio.gather(*tasks)
    engine.shutdown()
    start, end = window[0], window[-1]
    itls = [b - a for s in stamps for a, b in zip(s, s[1:]) if b >= start and a <= end]
    return itls, end - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--opt", default=None)
    args = ap.parse_args()
    results = {}
    for mode in ("hybrid", "chunked"):
        itls, prefill = asyncio.run(measure(mode, args.chunk, args.long_tokens, args.opt))
        q = statistics.quantiles(itls, n=100)
        results[mode] = q[98]
        print(f"{mode:8s}: long prompt prefilled in {prefill:6.2f} s; stream ITL over that window: "
              f"p50 {q[49] * 1e3:7.1f} ms, p99 {q[98] * 1e3:7.1f} ms, max {max(itls) * 1e3:7.1f} ms "
              f"({len(itls)} gaps)")
    print(f"ITL p99 hybrid / chunked: {results['hybrid'] / results['chunked']:.2f}")


if __name__ == "__main__":
    main()

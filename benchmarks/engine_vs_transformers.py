"""Throughput of lmserve's AsyncEngine against transformers generate(), same work, same run.

The work: N concurrent chat requests on the built-in model, each about P prompt tokens and
exactly O output tokens (eos ignored). lmserve serves them with continuous batching. transformers
does the same work two ways: one request at a time through generate() (what a plain
transformers program does; measured on the first --sequential-requests requests, as a rate), and
all requests as one left-padded batch through generate() (its best case for throughput).

    .venv/bin/python benchmarks/engine_vs_transformers.py [--requests 32] [--prompt-tokens 250]
        [--output-tokens 128] [--opt O2] [--sequential-requests 8] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

# lmserve before torch: its import sets libgomp's spinning (lmserve/openmp.py).
from lmserve import AsyncEngine  # isort: skip
import torch

from lmserve.models.builtin import builtin_model_path

TOPICS = ["lighthouses", "volcanoes", "the printing press", "honeybees", "glaciers", "chess",
          "the silk road", "jazz", "tides", "bridges", "comets", "coral reefs", "windmills",
          "paper", "owls", "deserts"]


def make_prompts(tokenizer, n: int, prompt_tokens: int) -> list[str]:
    """n distinct user messages of about ``prompt_tokens`` tokens each (template included)."""
    prompts = []
    for i in range(n):
        words = f"Request {i}. Tell me everything you know about {TOPICS[i % len(TOPICS)]}. "
        text = words
        while True:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            if len(ids) >= prompt_tokens:
                break
            text += f"Also mention detail number {len(ids)} and why it matters. "
        prompts.append(text)
    return prompts


async def run_lmserve(engine: AsyncEngine, prompts, output_tokens: int) -> tuple[float, int]:
    async def one(text: str) -> int:
        reply = await engine.chat.completions.create(
            messages=[{"role": "user", "content": text}], max_tokens=output_tokens,
            temperature=0, ignore_eos=True)
        return reply.usage.completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start, sum(counts)


def load_transformers():
    from transformers import AutoModelForCausalLM

    path = builtin_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def run_transformers(model, prompts: list[list[int]], output_tokens: int) -> tuple[float, int]:
    """All ``prompts`` as one left-padded batch through generate()."""
    width = max(len(p) for p in prompts)
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_tokens,
                             min_new_tokens=output_tokens, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - width) * len(prompts)


def run_transformers_sequential(model, prompts, output_tokens: int) -> tuple[float, int]:
    """Each prompt alone through generate(), one after the other."""
    elapsed, tokens = 0.0, 0
    for p in prompts:
        t, n = run_transformers(model, [p], output_tokens)
        elapsed, tokens = elapsed + t, tokens + n
    return elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=250)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--opt", default=None, help="lmserve optimisation level or knobs")
    ap.add_argument("--sequential-requests", type=int, default=8,
                    help="requests run one at a time through transformers (0 = skip)")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    n, out_len = args.requests, args.output_tokens
    engine = AsyncEngine(max_num_sequence=n, opt=args.opt, verbose=False,
                         max_total_sequence_length=n * (args.prompt_tokens + out_len + 64))
    prompts = make_prompts(engine.tokenizer, n, args.prompt_tokens)
    asyncio.run(run_lmserve(engine, prompts[:2], 4))  # warm-up
    lm_time, lm_tokens = asyncio.run(run_lmserve(engine, prompts, out_len))
    engine.shutdown()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"work: {n} chat requests, ~{args.prompt_tokens} prompt tokens, {out_len} output tokens")
    lm_rate = lm_tokens / lm_time
    print(f"{'lmserve (opt ' + (args.opt or 'O2') + ')':42s}: {lm_tokens:5d} tokens in {lm_time:7.2f} s "
          f"= {lm_rate:7.1f} output tok/s")
    if args.skip_transformers:
        return
    ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    model = load_transformers()
    runs = [("transformers, padded batch", run_transformers(model, ids, out_len))]
    if args.sequential_requests:
        k = args.sequential_requests
        runs.append((f"transformers, one at a time ({k} requests)",
                     run_transformers_sequential(model, ids[:k], out_len)))
    for name, (hf_time, hf_tokens) in runs:
        hf_rate = hf_tokens / hf_time
        print(f"{name:42s}: {hf_tokens:5d} tokens in {hf_time:7.2f} s = {hf_rate:7.1f} output tok/s"
              f"  -> lmserve is {lm_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()

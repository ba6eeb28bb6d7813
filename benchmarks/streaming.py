"""StreamingLLM's headline on the built-in model: perplexity along a long text with dense attention
(up to the model's context), a sliding window alone, and the window with 4 attention sinks; KV
memory along the text; decode speed deep into a stream against near its start.

Every position of the text is scored teacher-forced by the engine's own runner and KV-cache
manager on the engine thread: the text runs as one sequence in prefill chunks, each token
attending exactly what it would when decoded (its window, its sinks), and the manager gives back
the pages that fall out of the window after every chunk, as in serving. Dense attention runs only
up to the model's context (its positions are untrained past it).

    .venv/bin/python benchmarks/streaming.py [--window 1024] [--sinks 4] [--plot docs/img]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

# lmserve before torch: its import sets libgomp's spinning (lmserve/openmp.py).
from lmserve import Engine, SamplingParams  # isort: skip
import torch

from lmserve.request import Sequence
from lmserve.step import SeqStep, StepInput

TEXT = os.path.join(os.path.dirname(__file__), "data", "streaming_text.txt")
CHUNK = 512  # tokens scored per step


def score(engine: Engine, ids: list[int]) -> tuple[list[float], list[int]]:
    """Each position's negative log-likelihood of the next token, and the KV pages held after
    each chunk, for ``ids`` run as one sequence through ``engine``'s runner."""

    def run() -> tuple[list[float], list[int]]:
        core = engine._core
        seq = Sequence(request=None, index=0, token_ids=ids, seed=None)
        nll: list[float] = []
        held: list[int] = []
        try:
            while seq.num_computed < len(ids) - 1:
                start = seq.num_computed
                n = min(CHUNK, len(ids) - 1 - start)
                if not core.kv_manager.allocate(seq, n):
                    raise RuntimeError(f"no KV pages for positions {start}..{start + n}")
                step = StepInput([SeqStep(start, ids[start : start + n], list(seq.pages), n)])
                logp = core.runner.execute(step).log_softmax(-1)  # (n, V)
                targets = torch.tensor(ids[start + 1 : start + n + 1])
                nll += (-logp.gather(1, targets[:, None])[:, 0]).tolist()
                seq.num_computed += n
                core.kv_manager.release_past_window(seq)
                held.append(core.kv_manager.pages_held(seq))
        finally:
            core.kv_manager.free(seq)
        return nll, held

    return engine._loop.call(run, timeout=3600)


def segment_ppl(nll: list[float], size: int) -> list[float]:
    return [math.exp(sum(nll[i : i + size]) / len(nll[i : i + size])) for i in range(0, len(nll), size)]


def decode_speed(engine: Engine, ids: list[int], prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s of one stream after a ``prompt_len``-token prompt (first token excluded)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    stamps = [time.perf_counter() for out in engine.generate(ids[:prompt_len], params)
              for d in out.deltas if d.token_ids]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--segment", type=int, default=1024, help="tokens per perplexity segment")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the speed test")
    ap.add_argument("--tokens", type=int, default=None, help="score only the text's first N tokens")
    ap.add_argument("--near", type=int, default=1000, help="prompt tokens of the speed test's early stream")
    ap.add_argument("--far", type=int, default=16000, help="prompt tokens of its late stream")
    ap.add_argument("--plot", default=None, help="write streaming_ppl.png and streaming_memory.png here")
    a = ap.parse_args()

    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch threads "
          f"{torch.get_num_threads()}")
    text = open(TEXT, encoding="utf-8").read()
    results: dict[str, tuple[list[float], list[int]]] = {}
    configs = {
        "dense": {},
        f"window {a.window}": {"sliding_window_size": a.window},
        f"window {a.window} + {a.sinks} sinks": {"sliding_window_size": a.window,
                                                 "attention_sink_size": a.sinks},
    }
    context = None
    for name, window in configs.items():
        with Engine(max_num_sequence=1, prefill_chunk_size=CHUNK, prefix_cache_mode="disable",
                    max_single_sequence_length=None if not window else 10**6, verbose=False,
                    **window) as engine:
            ids = engine.tokenizer.encode(text)[: a.tokens]
            context = engine._core.args.context_length
            kv_per_token = engine.plan.memory.kv_per_token
            page = engine.plan.page_size
            t0 = time.perf_counter()
            results[name] = score(engine, ids[: context] if not window else ids)
            print(f"{name}: scored {len(results[name][0])} positions in {time.perf_counter() - t0:.0f} s")
    print(f"text: {len(ids)} tokens; model context {context}; segments of {a.segment} tokens\n")

    segs = {name: segment_ppl(nll, a.segment) for name, (nll, _) in results.items()}
    names = list(configs)
    print("| tokens | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for i in range(max(len(s) for s in segs.values())):
        cells = [f"{segs[n][i]:.2f}" if i < len(segs[n]) else "-" for n in names]
        print(f"| {i * a.segment}-{min((i + 1) * a.segment, len(ids) - 1)} | " + " | ".join(cells) + " |")
    dense_n = len(results["dense"][0])
    overall = {n: math.exp(sum(results[n][0][:dense_n]) / dense_n) for n in names}
    past = {n: math.exp(sum(results[n][0][dense_n:]) / max(1, len(results[n][0]) - dense_n))
            for n in names[1:]}
    print(f"\nperplexity over the first {dense_n} tokens (dense can run): "
          + ", ".join(f"{n} {v:.3f}" for n, v in overall.items()))
    sinks = names[2]
    print(f"  {sinks} / dense: {overall[sinks] / overall['dense']:.4f}; window only / dense: "
          f"{overall[names[1]] / overall['dense']:.4f}")
    if len(ids) - 1 > dense_n:
        print(f"perplexity past the context ({dense_n}+): "
              + ", ".join(f"{n} {v:.3f}" for n, v in past.items()))
    for n in names:
        held = results[n][1]
        print(f"KV held by the stream after each chunk, {n}: at most {max(held)} pages = "
              f"{max(held) * page * kv_per_token / 2**20:.1f} MiB (at the end {held[-1]} pages)")

    # Decode speed deep in a stream against near its start, window + sinks, interleaved rounds.
    with Engine(max_num_sequence=1, prefill_chunk_size=CHUNK, prefix_cache_mode="disable",
                max_single_sequence_length=10**6, verbose=False, sliding_window_size=a.window,
                attention_sink_size=a.sinks) as engine:
        early, late = [], []
        for _ in range(a.rounds):
            early.append(decode_speed(engine, ids, a.near, 64))
            late.append(decode_speed(engine, ids, a.far, 64))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        ratios = sorted(x / y for x, y in zip(late, early))
        print(f"\ndecode tokens/s after a {a.near}-token prompt: median {med(early):.1f}; after {a.far}: "
              f"median {med(late):.1f}; per-round ratio far/near median {ratios[len(ratios) // 2]:.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)})")

    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for n in names:
            s = segs[n]
            ax.plot([(i + 0.5) * a.segment for i in range(len(s))], s, marker="o", ms=3, label=n)
        ax.axvline(context, color="grey", ls="--", lw=1)
        ax.text(context, ax.get_ylim()[1], " model context", va="top", fontsize=8)
        ax.set(xlabel="position in the text (tokens)", ylabel=f"perplexity per {a.segment} tokens",
               title="SmolLM2-135M (built-in) streaming a long text", yscale="log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.plot, "streaming_ppl.png"), dpi=110)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for n in names:
            held = results[n][1]
            ax.plot([min((i + 1) * CHUNK, len(ids) - 1) for i in range(len(held))],
                    [h * page * kv_per_token / 2**20 for h in held], label=n)
        ax.set(xlabel="position in the text (tokens)", ylabel="KV held by the stream (MiB)",
               title="KV memory along the stream")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.plot, "streaming_memory.png"), dpi=110)
        print(f"plots written to {a.plot}")


if __name__ == "__main__":
    main()

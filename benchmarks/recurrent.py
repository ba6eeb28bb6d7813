"""Decode time per token against context length: a Mamba2 model against an attention (Llama)
model of the same width and depth and about the same number of weights, both with random
weights (transformers' initialisation; speed does not depend on the values).

A recurrent layer's state has one size whatever the context, so its decode step should cost the
same at 1k and 32k tokens; an attention layer reads every cached key and value. Each point is
one decode step of ``--batch`` sequences, every one at that context, through the engine's own
runner (the step the scheduler would hand it: a sequence's pages or state slot, its newest
token); the KV cache holds zeros, which cost what real keys cost. Rounds interleave the models
and lengths; the table shows medians over rounds.

    .venv/bin/python benchmarks/recurrent.py [--rounds 5] [--batch 1] [--plot docs/img]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

# lmserve before torch: its import sets libgomp's spinning (lmserve/openmp.py).
from lmserve import Engine  # isort: skip
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM

from lmserve.models.builtin import builtin_model_path
from lmserve.step import SeqStep, StepInput
from lmserve.tokenizer import Tokenizer
from lmserve.util import cdiv

LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768]
WIDTH, DEPTH, VOCAB = 768, 24, 49152  # the built-in tokenizer's vocabulary


def save_models(root: str) -> dict[str, str]:
    """A Mamba2 model (Mamba-130m's shape) and a Llama model of the same width and depth whose
    MLP is sized to match its weights, saved as Hugging Face directories."""
    mamba = Mamba2ForCausalLM(Mamba2Config(hidden_size=WIDTH, num_hidden_layers=DEPTH, num_heads=24,
                                           head_dim=64, state_size=128, n_groups=1, expand=2,
                                           vocab_size=VOCAB, tie_word_embeddings=True))
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=12,
                                         num_key_value_heads=4, intermediate_size=1024, vocab_size=VOCAB,
                                         max_position_embeddings=2 * LENGTHS[-1], tie_word_embeddings=True))
    tokenizer = Tokenizer.from_model(builtin_model_path()).hf
    dirs = {}
    for name, model in (("mamba2", mamba), ("llama", llama)):
        dirs[name] = os.path.join(root, name)
        model.save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M weights")
    return dirs


def decode_step(engine: Engine, context: int, batch: int) -> StepInput:
    """``batch`` sequences each at ``context`` tokens: their own pages (or state slot), one token."""
    core = engine._core
    page = core.plan.page_size
    pages = cdiv(context + 1, page) if core.plan.num_pages else 0
    return StepInput([SeqStep(start=context, token_ids=[100 + i], page_table=list(range(i * pages, (i + 1) * pages)),
                              num_logits=1, state_slot=i if core.plan.state else -1) for i in range(batch)])


def time_steps(engine: Engine, step: StepInput, n: int) -> float:
    """Median seconds of ``n`` runs of ``step`` (after one warm-up run)."""
    def run() -> float:
        engine._core.runner.execute(step)
        times = []
        for _ in range(n):
            started = time.perf_counter()
            engine._core.runner.execute(step)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    return engine._loop.call(run, timeout=3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per point and round")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--opt", default=None, help="opt level (default: the engine's)")
    parser.add_argument("--plot", default=None, help="directory for recurrent_decode.png")
    a = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"batch {a.batch}, opt {a.opt or 'default'}")
    with tempfile.TemporaryDirectory() as root:
        dirs = save_models(root)
        longest = LENGTHS[-1] + 64
        engines = {name: Engine(model=d, opt=a.opt, max_num_sequence=a.batch, prefill_chunk_size=256,
                                max_single_sequence_length=longest, max_total_sequence_length=a.batch * longest,
                                verbose=False) for name, d in dirs.items()}
        times: dict[tuple[str, int], list[float]] = {}
        for r in range(a.rounds):
            for length in LENGTHS:
                for name, engine in engines.items():
                    t = time_steps(engine, decode_step(engine, length, a.batch), a.steps)
                    times.setdefault((name, length), []).append(t)
            print(f"round {r + 1}/{a.rounds} done")
        for engine in engines.values():
            engine.shutdown()
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(f"\n{'context':>8} {'mamba2 ms/step':>15} {'llama ms/step':>14} {'llama/mamba2':>13}"
          f" {'mamba2 tok/s':>13} {'llama tok/s':>12}")
    for length in LENGTHS:
        mamba, llama = ms["mamba2", length], ms["llama", length]
        print(f"{length:>8} {mamba:>15.2f} {llama:>14.2f} {llama / mamba:>13.2f} {1000 * a.batch / mamba:>13.1f}"
              f" {1000 * a.batch / llama:>12.1f}")
    for name in ("mamba2", "llama"):
        print(f"{name}: step at {LENGTHS[-1]} / at {LENGTHS[0]}: "
              f"{ms[name, LENGTHS[-1]] / ms[name, LENGTHS[0]]:.2f}")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, label in (("mamba2", "Mamba2 (recurrent state)"), ("llama", "Llama (paged KV)")):
            ax.plot(LENGTHS, [1000 * a.batch / ms[name, n] for n in LENGTHS], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"decode tokens/s (batch {a.batch})")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(a.plot, "recurrent_decode.png")
        fig.savefig(path, dpi=120)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Sampling a step's tokens: lmserve's draw (one uniform number a row, a two-level inverse CDF)
against the exponential race it replaced, and against ``torch.multinomial``.

For each batch size times a whole ``sampler.sample`` call on random ``(B, V)`` logits with the
built-in model's vocabulary, every row seeded (the engine gives every sampled row its own
generator, so that a seeded request's tokens do not depend on its batch), with two settings:
temperature 1 alone, and temperature 0.7 with top-p 0.9. The peers replace only the draw from
the filtered probabilities:

- ``race``: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` drawn per row from its generator
  (what lmserve did before, and what vLLM does on GPUs);
- ``multinomial``: ``torch.multinomial`` per row with its generator;
- ``torch cdf``: the same two-level inverse CDF all in torch operations (what lmserve did until
  2026-12-06; now the blocks' masses are one torch operation and the rest numpy).

Rounds are interleaved; prints the median milliseconds per call and lmserve's speed-up.

    .venv/bin/python benchmarks/sampling.py [--rounds 15] [--batches 1 16 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmserve import sampler
from lmserve.sampler import SamplingBatch, sample
from lmserve.sampling_params import SamplingParams

VOCAB = 49152  # SmolLM2


# Each draw returns the tokens and no margins (``sample`` asks for none here).

def race(probs: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, None]:
    noise = torch.stack([torch.empty(probs.shape[1]).exponential_(generator=batch.generators[r])
                         for r in batch.random_rows])
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1), None


def multinomial(probs: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, None]:
    return torch.cat([torch.multinomial(probs[r], 1, generator=batch.generators[r])
                      for r in batch.random_rows]), None


def torch_cdf(probs: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, None]:
    uniforms = torch.stack([torch.rand((), dtype=torch.float64, generator=batch.generators[r])
                            for r in batch.random_rows])
    rows, size = len(batch.random_rows), sampler._CDF_BLOCK
    blocks = probs.view(rows, -1, size)  # (R, NB, BS); the vocabulary is whole blocks
    block_cdf = blocks.sum(-1).double().cumsum(-1)
    target = uniforms[:, None] * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True)[:, 0].clamp_(max=block_cdf.shape[1] - 1)
    below = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    within_cdf = blocks[torch.arange(rows), block].cumsum(-1)
    within = torch.searchsorted(within_cdf, (target[:, 0] - below).float()[:, None], right=True)[:, 0]
    return block * size + within.clamp_(max=size - 1), None


def time_call(draw, logits: torch.Tensor, params: list[SamplingParams]) -> float:
    original = sampler._draw
    sampler._draw = draw or original
    try:
        generators = [torch.Generator().manual_seed(i) for i in range(len(params))]
        start = time.perf_counter()
        batch = SamplingBatch.build(params, generators, [[1]] * len(params), [[]] * len(params),
                                    VOCAB, "cpu")
        sample(logits, batch)
        return time.perf_counter() - start
    finally:
        sampler._draw = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    args = parser.parse_args()
    settings = {"T=1": SamplingParams(temperature=1.0),
                "T=0.7 top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9)}
    peers = {"lmserve": None, "race": race, "multinomial": multinomial, "torch cdf": torch_cdf}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocabulary {VOCAB}")
    print(f"{'batch':>5} {'setting':<16}" + "".join(f"{p:>13}" for p in peers) + "   speed-up")
    for b in args.batches:
        logits = torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(b)) * 4
        for label, params in settings.items():
            times = {p: [] for p in peers}
            for _ in range(args.rounds):
                for name, draw in peers.items():
                    times[name].append(time_call(draw, logits, [params] * b))
            ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            ratios = ", ".join(f"{ms[p] / ms['lmserve']:.1f}x vs {p}" for p in peers if p != "lmserve")
            print(f"{b:>5} {label:<16}" + "".join(f"{ms[p]:>10.2f} ms" for p in peers) + f"   {ratios}")


if __name__ == "__main__":
    main()

"""A draft model's drafts for requests that sample: drawn with the target's own noise.

A sampling request draws the token at each position at a uniform quantile of its processed
distribution, the quantile a function of the sequence's seed and the position only
(``sampler.position_generator``). A draft model drafts, at each position, the token that its own
distribution, processed with the request's settings (temperature, top-k/p, min-p, bias,
penalties over the output and the drafts before), puts at that same quantile. Verification is
unchanged: the target samples every position with its noise and accepts drafts equal to its
samples, so the output is the target's own samples, token for token what it is without
speculation. What changes is how often a draft is right: where the two distributions are close
they put the quantile in the same token almost always, while the draft's most likely token is
right only as often as the target happens to draw it. This is drafter-invariant speculative
decoding (Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant
Speculative Decoding", 2024), with the sampler's inverse CDF in token-id order as the coupling
instead of their Gumbel-max race over the vocabulary: a draw stays one uniform number a row.

EAGLE and Medusa heads draft their best tokens: with heads trained here (right 20-30% of the
time) draws were no more often right than the best tokens, and cost a sampling pass each.
"""

from __future__ import annotations

import torch

from lmserve.request import Sequence
from lmserve.sampler import sample, sequence_batch
from lmserve.sampling_params import SamplingParams


def plain_greedy(params: SamplingParams) -> bool:
    """Whether the target's token is the raw logits' argmax (no noise, bias or penalties), so a
    draft model's own best token is already its draw."""
    return params.is_greedy and not params.logit_bias and params.repetition_penalty == 1.0 \
        and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0


def lead_with(drawn: int, candidates: list[int]) -> list[int]:
    """``candidates`` (best first) with the ``drawn`` token in the best one's place and the others
    after it, as many as there were."""
    return [drawn] + [t for t in candidates if t != drawn][: len(candidates) - 1]


def coupled_tokens(logits: torch.Tensor, rows: list[tuple[Sequence, list[int]]],
                   eos_token_ids: frozenset[int] = frozenset()) -> tuple[list[int], list[float]]:
    """Per row of a draft model's ``logits`` ``(R, V)``, the token the target's sampler would
    draw at the row's position were they the target's, and how far the row's quantile lies
    from the nearer edge of that token's share (``SampleResult.margins``: near an edge, the
    target's slightly different distribution may put it in a neighbour). Row ``(seq, before)``
    drafts the token after ``seq``'s tokens and the drafts ``before``; ``eos_token_ids``: what
    ``min_tokens`` bans, as for the target."""
    drawn = sample(logits.float(), sequence_batch(rows, logits.shape[1], logits.device,
                                                  tuple(eos_token_ids)), margins=True)
    assert drawn.margins is not None  # (asked for: margins=True)
    return drawn.token_ids.tolist(), drawn.margins.tolist()

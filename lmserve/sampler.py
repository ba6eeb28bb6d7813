"""Choosing the next token of every running sequence from one step's logits.

Pure functions of tensors, in the spirit of gpt-fast's ``generate.py``: once per step the engine
builds a :class:`SamplingBatch` (one row per running sequence) and calls :func:`sample` on the
``(B, V)`` logits. The stages run in this order:

0. the grammar's token mask on constrained rows (structured output): disallowed tokens -> -inf;
1. ``logit_bias`` (and, before ``min_tokens`` output tokens, a ban on stop and eos tokens);
2. repetition, then frequency and presence penalties;
3. greedy rows (temperature 0) take the argmax here;
4. temperature, then top-k, top-p and min-p filtering;
5. a draw from what is left, at a uniform quantile of the row's distribution (``_inverse_cdf``).

Every non-greedy row draws its one uniform number from its own ``torch.Generator`` only, so a
seeded row gets the same tokens whatever other rows share the batch, and in whatever order. (One
number a row, not a race of ``V`` exponential draws: those cost 1.7 ms a row on a CPU, most of
a batch-16 decode step of the built-in model.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch

from lmserve.sampling_params import SamplingParams
from lmserve.structured.xgrammar_lib import apply_bitmask
from lmserve.util import cdiv

if TYPE_CHECKING:
    from lmserve import request

# Dividing float32 logits by a temperature below this can overflow them to inf (and the
# softmax to NaN); the distribution there is already a point mass on the argmax.
_MIN_TEMPERATURE = 1e-6


@dataclass
class SamplingBatch:
    """One step's sampling settings, one row per running sequence, on the logits' device.

    Build it with :meth:`build`. A stage's tensors are None when no row needs that stage, so
    :func:`sample` skips it; when every row is plain greedy, ``greedy_fast_path`` is set and
    sampling is a single argmax.
    """

    vocab_size: int
    greedy_fast_path: bool  # all rows greedy, no bias, penalties or logprobs
    greedy: torch.Tensor  # (B,) bool
    random_rows: list[int]  # rows that draw a token, i.e. not greedy
    generators: list[Optional[torch.Generator]]  # per row; None draws from torch's default one
    temperatures: torch.Tensor  # (B,) float32; 1 on greedy rows, which never use it
    # Additive biases as sparse entries: logit_bias values and -inf bans for min_tokens.
    bias_index: Optional[torch.Tensor]  # (2, N) int64: row, token id
    bias_values: Optional[torch.Tensor]  # (N,) float32
    repetition_penalties: Optional[torch.Tensor]  # (B,) float32, 1 where off
    seen: Optional[torch.Tensor]  # (B, V) bool: token occurs in the prompt or the output
    frequency_penalties: Optional[torch.Tensor]  # (B,) float32, 0 where off
    presence_penalties: Optional[torch.Tensor]  # (B,) float32, 0 where off
    output_counts: Optional[torch.Tensor]  # (B, V) float32: occurrences in the output
    top_k: Optional[torch.Tensor]  # (B,) int64, 0 where off
    max_top_k: int  # largest k of any row; 0 when top_k is None
    top_p: Optional[torch.Tensor]  # (B,) float32, 1 where off
    min_p: Optional[torch.Tensor]  # (B,) float32, 0 where off
    num_logprobs: Optional[torch.Tensor]  # (B,) int64: top alternatives asked, 0 where off
    max_logprobs: Optional[int]  # K of the result; None when no row asked for logprobs
    # Structured output: (B, ceil(V / 32)) int32 allowed-token bits, applied on bitmask_rows.
    token_bitmask: Optional[torch.Tensor] = None
    bitmask_rows: Optional[list[int]] = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[Optional[torch.Generator]],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: Union[torch.device, str],
        eos_token_ids: Sequence[int] = (),
        token_bitmask: Optional[tuple[torch.Tensor, list[int]]] = None,
    ) -> SamplingBatch:
        """Gather the settings of ``B = len(params)`` rows into tensors on ``device``.

        ``generators[i]`` must live on ``device``. ``eos_token_ids`` are banned, together with
        the row's ``stop_token_ids``, while a row has fewer than ``min_tokens`` output tokens.
        ``token_bitmask``: the grammar masks and the rows they constrain (``fill_bitmask``).
        Token ids are assumed checked with :meth:`SamplingParams.check_vocab`.
        """
        num_rows = len(params)
        for name, rows in (
            ("generators", generators),
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
        ):
            if len(rows) != num_rows:
                raise ValueError(f"{name} has {len(rows)} rows, params has {num_rows}")

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def ints(values: Union[list[int], list[list[int]]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        greedy = [p.is_greedy for p in params]
        random_rows = [row for row, is_greedy in enumerate(greedy) if not is_greedy]

        # Filters never change a greedy row's argmax, so only drawing rows switch them on.
        top_k = [
            0 if is_greedy or not 0 < p.top_k < vocab_size else p.top_k
            for p, is_greedy in zip(params, greedy)
        ]
        top_p = [1.0 if is_greedy else p.top_p for p, is_greedy in zip(params, greedy)]
        min_p = [0.0 if is_greedy else p.min_p for p, is_greedy in zip(params, greedy)]

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for row, (p, output) in enumerate(zip(params, output_token_ids)):
            for token_id, bias in (p.logit_bias or {}).items():
                bias_rows.append(row)
                bias_ids.append(token_id)
                bias_values.append(bias)
            if len(output) < p.min_tokens:
                banned = set(p.stop_token_ids) | set(eos_token_ids)
                bias_rows.extend([row] * len(banned))
                bias_ids.extend(banned)
                bias_values.extend([float("-inf")] * len(banned))

        use_repetition = any(p.repetition_penalty != 1.0 for p in params)
        use_counts = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        output_counts = None
        if use_repetition or use_counts:
            output_counts = _token_counts(output_token_ids, vocab_size, device)
        seen = None
        if use_repetition:
            prompt_counts = _token_counts(prompt_token_ids, vocab_size, device)
            assert output_counts is not None  # counted above for repetition penalties too
            seen = (prompt_counts > 0) | (output_counts > 0)

        want_logprobs = any(p.logprobs is not None for p in params)
        num_logprobs = [p.logprobs or 0 for p in params]

        return cls(
            vocab_size=vocab_size,
            greedy_fast_path=not random_rows
            and not bias_rows
            and not use_repetition
            and not use_counts
            and not want_logprobs,
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            random_rows=random_rows,
            generators=list(generators),
            temperatures=floats(
                [1.0 if g else max(p.temperature, _MIN_TEMPERATURE) for p, g in zip(params, greedy)]
            ),
            bias_index=ints([bias_rows, bias_ids]) if bias_rows else None,
            bias_values=floats(bias_values) if bias_rows else None,
            repetition_penalties=(
                floats([p.repetition_penalty for p in params]) if use_repetition else None
            ),
            seen=seen,
            frequency_penalties=(
                floats([p.frequency_penalty for p in params]) if use_counts else None
            ),
            presence_penalties=floats([p.presence_penalty for p in params]) if use_counts else None,
            output_counts=output_counts if use_counts else None,
            top_k=ints(top_k) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=floats(top_p) if any(v < 1.0 for v in top_p) else None,
            min_p=floats(min_p) if any(v > 0.0 for v in min_p) else None,
            num_logprobs=ints(num_logprobs) if want_logprobs else None,
            max_logprobs=max(num_logprobs) if want_logprobs else None,
            token_bitmask=token_bitmask[0] if token_bitmask else None,
            bitmask_rows=token_bitmask[1] if token_bitmask else None,
        )


@dataclass
class SampleResult:
    """The tokens chosen for a batch, and their logprobs when any row asked for them.

    Logprobs come from the model's raw distribution, ``log_softmax`` of the logits before
    bias, penalties, temperature or filtering (what vLLM reports by default). Row ``i``'s
    alternatives are the first ``logprobs`` entries it asked for; past them ``top_ids`` is -1
    and ``top_logprobs`` is -inf. Rows that did not ask still get values; ignore them.
    """

    token_ids: torch.Tensor  # (B,) int64
    logprobs: Optional[torch.Tensor] = None  # (B,) float32: of the chosen token
    top_ids: Optional[torch.Tensor] = None  # (B, K) int64, most likely first
    top_logprobs: Optional[torch.Tensor] = None  # (B, K) float32, descending
    # With ``sample(..., margins=True)``: how far each drawing row's uniform quantile lies from
    # the nearer edge of the drawn token's share of the distribution (as a share of the whole;
    # a drafter's draw near an edge is fragile, ``spec.coupled``); inf on greedy rows.
    margins: Optional[torch.Tensor] = None  # (B,) float64


def sample(logits: torch.Tensor, batch: SamplingBatch, margins: bool = False) -> SampleResult:
    """Choose one token per row of ``logits`` (``(B, V)``, float32) as ``batch`` says.

    ``logits`` is not modified. Logprobs, when asked, are those of the model's raw
    distribution (``log_softmax(logits)``), not of the processed one that was sampled, nor of
    the grammar's mask. ``margins``: also each draw's margin (``SampleResult.margins``).
    """
    if logits.shape != (batch.greedy.shape[0], batch.vocab_size):
        raise ValueError(
            f"logits have shape {tuple(logits.shape)}, the batch expects "
            f"({batch.greedy.shape[0]}, {batch.vocab_size})"
        )
    raw = logits
    if batch.token_bitmask is not None:
        logits = logits.float().clone()
        assert batch.bitmask_rows is not None  # given with token_bitmask
        apply_bitmask(logits, batch.token_bitmask, batch.bitmask_rows)
    edge = torch.full((len(batch.greedy),), float("inf"), dtype=torch.float64) if margins else None
    if batch.greedy_fast_path:
        return SampleResult(token_ids=logits.argmax(dim=-1), margins=edge)

    logits = logits.float()
    processed = _apply_bias_and_penalties(logits, batch)  # (B, V)
    if not batch.random_rows:
        token_ids = processed.argmax(dim=-1)  # (B,)
    else:
        token_ids, drawn_edge = _draw(_filtered_probs(processed, batch), batch)  # (B,) each
        if edge is not None:  # margins asked
            edge[batch.random_rows] = drawn_edge
        if len(batch.random_rows) < len(token_ids):  # greedy rows take the argmax
            token_ids = torch.where(batch.greedy, processed.argmax(dim=-1), token_ids)

    if batch.max_logprobs is None:
        return SampleResult(token_ids=token_ids, margins=edge)
    raw_logprobs = raw.float().log_softmax(dim=-1)  # (B, V)
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # (B,)
    top_logprobs, top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)  # (B, K) each
    positions = torch.arange(batch.max_logprobs, device=logits.device)  # (K,)
    assert batch.num_logprobs is not None  # set with max_logprobs
    unasked = positions[None, :] >= batch.num_logprobs[:, None]  # (B, K)
    return SampleResult(
        token_ids=token_ids,
        logprobs=chosen,
        top_ids=top_ids.masked_fill_(unasked, -1),
        top_logprobs=top_logprobs.masked_fill_(unasked, float("-inf")),
        margins=edge,
    )


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> SampleResult:
    """The raw logprob of ``targets[i]`` under row ``i`` of ``logits`` (``(N, V)``; ``targets``
    ``(N,)`` int64) and the row's ``k`` most likely tokens: prompt logprobs."""
    logprobs = logits.float().log_softmax(dim=-1)  # (N, V)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)  # (N,)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # (N, k) each
    return SampleResult(token_ids=targets, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


def _token_counts(
    rows: list[list[int]], vocab_size: int, device: Union[torch.device, str]
) -> torch.Tensor:
    """Occurrences of each token id in each row: ``(B, V)`` float32."""
    width = max((len(row) for row in rows), default=0)
    # Pad with an id one past the vocabulary, counted in a spare column that is then dropped.
    padded = [row + [vocab_size] * (width - len(row)) for row in rows]
    ids = torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))  # (B, V + 1)
    return counts[:, :vocab_size]


def _apply_bias_and_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, then repetition, frequency and presence penalties, on a copy of the logits
    (the logits themselves when there are none)."""
    if batch.bias_index is None and batch.repetition_penalties is None \
            and batch.output_counts is None:
        return logits
    x = logits.clone()  # (B, V)
    if batch.bias_index is not None:
        assert batch.bias_values is not None  # set with bias_index
        x.index_put_((batch.bias_index[0], batch.bias_index[1]), batch.bias_values, accumulate=True)
    if batch.repetition_penalties is not None:
        penalty = batch.repetition_penalties[:, None]  # (B, 1)
        # Dividing a positive logit and multiplying a negative one both make the token rarer.
        penalised = torch.where(x > 0, x / penalty, x * penalty)  # (B, V)
        assert batch.seen is not None  # set with repetition_penalties
        x = torch.where(batch.seen, penalised, x)
    if batch.output_counts is not None:
        counts = batch.output_counts  # (B, V)
        # set with output_counts (frequency or presence penalties)
        assert batch.frequency_penalties is not None and batch.presence_penalties is not None
        x -= batch.frequency_penalties[:, None] * counts
        x -= batch.presence_penalties[:, None] * (counts > 0)
    return x


def _filtered_probs(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (on a copy of ``x``); returns the
    probabilities."""
    x = x / batch.temperatures[:, None]  # (B, V)
    if batch.top_k is not None:
        _top_k_(x, batch.top_k, batch.max_top_k)
    if batch.top_p is not None:
        _top_p_(x, batch.top_p)
    if batch.min_p is not None:
        _min_p_(x, batch.min_p)
    return x.softmax(dim=-1)


def _top_k_(x: torch.Tensor, k: torch.Tensor, max_k: int) -> None:
    """Keep each row's ``k`` largest logits (all of them where k is 0); ties at the edge stay."""
    largest = x.topk(max_k, dim=-1).values  # (B, max_k), descending
    kth = largest.gather(1, (k.clamp(min=1) - 1)[:, None])  # (B, 1)
    kth.masked_fill_((k == 0)[:, None], float("-inf"))
    x.masked_fill_(x < kth, float("-inf"))


# Top-p looks for the nucleus among each row's most likely tokens first: a partial selection,
# where sorting the whole vocabulary costs 3 ms a row on a CPU. Rows whose nucleus is wider sort.
_TOP_P_CANDIDATES = 1024


def _top_p_(x: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep each row's most likely tokens until their mass reaches ``top_p``."""
    probs = x.softmax(dim=-1)  # (B, V)
    candidates = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)  # (B, C) each
    vocab_size = probs.shape[-1]
    drop = _outside_nucleus(candidates.values, candidates.indices, top_p, vocab_size)  # (B, V)
    wide = (candidates.values.sum(dim=-1) < top_p) & (top_p < 1.0)  # (B,)
    if wide.any():
        sorted_probs, order = probs[wide].sort(dim=-1, descending=True)
        drop[wide] = _outside_nucleus(sorted_probs, order, top_p[wide], vocab_size)
    x.masked_fill_(drop, float("-inf"))


def _outside_nucleus(sorted_probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
    """The tokens ``(B, V)`` outside each row's nucleus, given its most likely tokens' ``order``
    and probabilities ``(B, C)``, descending (C < V: the tokens past them are outside)."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, C)
    # Rows at 1.0 are exempt: rounding in the cumsum can push mass_before past 1 and drop
    # tail tokens.
    exempt = (top_p >= 1.0)[:, None]  # (B, 1)
    keep_sorted = (mass_before < top_p[:, None]) | exempt  # (B, C)
    keep_sorted[:, 0] = True  # the most likely token always stays (top_p may round to 0)
    keep = exempt.expand(-1, vocab_size).clone()  # (B, V)
    keep.scatter_(1, order, keep_sorted)
    return ~keep


def _min_p_(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens less likely than ``min_p`` times the row's most likely token."""
    probs = x.softmax(dim=-1)  # (B, V)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    x.masked_fill_(probs < threshold, float("-inf"))


# Tokens per block of the two-level inverse CDF (``_inverse_cdf``).
_CDF_BLOCK = 256


def _draw(probs: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a token per row from ``probs`` (``(B, V)``) with one uniform number per drawing
    row, from the row's own generator, so a row's draw does not depend on the batch around it;
    greedy rows draw nothing (their entry is 0, replaced by the caller). Also the drawing rows'
    margins (``_inverse_cdf``)."""
    rows = batch.random_rows
    generators = [batch.generators[row] for row in rows]
    uniforms = np.empty(len(rows))
    shared = [i for i, g in enumerate(generators) if g is None]
    for i, g in enumerate(generators):
        if g is not None:
            uniforms[i] = torch.rand((), dtype=torch.float64, generator=g).item()
    if shared:
        uniforms[shared] = torch.rand(len(shared), dtype=torch.float64).numpy()
    picked = probs if len(rows) == probs.shape[0] else probs[rows]
    picked_tokens, margins = _inverse_cdf(picked.detach().cpu(), uniforms)
    tokens = torch.from_numpy(picked_tokens).to(probs.device)
    if len(rows) == probs.shape[0]:
        return tokens, torch.from_numpy(margins)
    drawn = torch.zeros(probs.shape[0], dtype=torch.int64, device=probs.device)
    drawn[rows] = tokens
    return drawn, torch.from_numpy(margins)


def _inverse_cdf(probs: torch.Tensor, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token ``(R,)`` at quantile ``uniforms (R,)`` of each row of ``probs (R, V)``
    (float32 on the CPU, unnormalised), and how far the quantile lies from the nearer edge of
    that token's share, as a share of the row's mass ``(R,)`` float64.

    Two levels, for speed and precision: the block of ``_CDF_BLOCK`` tokens from the blocks'
    masses accumulated in float64, then the token within it from a float32 cumulative sum of that
    block only. Rounding then moves a token's share by about 1e-7 of its block's mass, where
    one float32 cumulative sum over the vocabulary moves it by 1e-7 of the whole: 3e-4 in total
    variation on a flat distribution of 49k tokens. A token of probability 0 is never drawn; a
    row without mass (a grammar that no token can continue masks every token: NaN) gets the
    last token, which the grammar then refuses. The blocks' masses in one torch operation (on
    all threads), the rest in numpy: a dozen small operations on a block or a row of block
    masses, each a fraction of a torch operation's fixed cost (a row 0.045 ms against 0.106
    all in torch; 16 rows 0.24 ms all in numpy).
    """
    num_rows, vocab_size = probs.shape
    num_blocks = cdiv(vocab_size, _CDF_BLOCK)
    if vocab_size % _CDF_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, num_blocks * _CDF_BLOCK - vocab_size))
    rows = np.arange(num_rows)
    masses = probs.view(num_rows, num_blocks, _CDF_BLOCK).sum(-1)  # (R, NB)
    blocks = probs.numpy().reshape(num_rows, num_blocks, _CDF_BLOCK)  # (R, NB, BS)
    block_cdf = masses.numpy().astype(np.float64).cumsum(-1)  # (R, NB)
    total = block_cdf[:, -1]
    target = uniforms * total  # (R,), below the total
    block = _search(block_cdf, target)  # (R,)
    below = np.where(block > 0, block_cdf[rows, np.maximum(block - 1, 0)], 0.0)
    within_cdf = blocks[rows, block].cumsum(-1, dtype=np.float32)  # (R, BS)
    inside = (target - below).astype(np.float32)  # (R,)
    within = _search(within_cdf, inside)
    high = within_cdf[rows, within]  # the token's share ends here, and starts its mass before
    low = high - blocks[rows, block, within]
    empty = ~(total > 0)  # (NaN, or no mass)
    margin = np.maximum(np.minimum(inside - low, high - inside), 0).astype(np.float64)
    margin = np.where(empty, 0.0, margin / np.where(empty, 1.0, total))
    tokens = np.where(empty, vocab_size - 1, np.minimum(block * _CDF_BLOCK + within, vocab_size - 1))
    return tokens.astype(np.int64), margin


def _search(cdf: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row, the first index whose cumulative value exceeds ``target (R,)``, or where
    rounding put the target at the end, the last index that adds mass."""
    found = (cdf <= target[:, None]).sum(-1)
    last = (cdf < cdf[:, -1:]).sum(-1)
    return np.minimum(np.minimum(found, last), cdf.shape[1] - 1)


def position_generator(seed: Optional[int], position: int) -> Optional[torch.Generator]:
    """The noise for sampling the token at ``position``: a function of the seed and the position
    only (SplitMix64 of both), so a seeded request draws the same tokens whatever its batch
    company, preemptions, or how many tokens a step verified (speculative decoding); and a
    drafter can draw with the noise the target will draw with (``spec.coupled``)."""
    if seed is None:
        return None
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed((z ^ (z >> 31)) >> 1)


_MASK64 = (1 << 64) - 1


def sequence_batch(rows: list[tuple[request.Sequence, list[int]]], vocab_size: int,
                   device: Union[torch.device, str], eos_token_ids: Sequence[int] = (),
                   token_bitmask: Optional[tuple[torch.Tensor, list[int]]] = None) -> SamplingBatch:
    """The settings of rows that each sample a sequence's next token: row ``(seq, before)`` the
    token after ``seq``'s tokens and the drafts ``before`` (as if they were accepted), with the
    noise of its position (``position_generator``) and the penalties over the output so far."""
    return SamplingBatch.build(
        params=[seq.request.params for seq, _ in rows],
        generators=[position_generator(seq.seed, len(seq.token_ids) + len(before)) for seq, before in rows],
        prompt_token_ids=[seq.request.prompt_token_ids for seq, _ in rows],
        output_token_ids=[seq.output_token_ids + before for seq, before in rows],
        vocab_size=vocab_size,
        device=device,
        eos_token_ids=eos_token_ids,
        token_bitmask=token_bitmask,
    )

"""The adaptive draft length (``spec_draft_length=0``): the draft length that gives the most
tokens per second, found by measuring while serving.

What a draft costs depends on the machine, the model, the opt level and the batch (on a CPU,
one stream reads every weight for one token and a few more tokens cost little; a full batch is
compute-bound and every extra token costs as much), and what it earns depends on the workload
(copying a given text accepts most drafts, free chat few). A model of either was wrong by tens
of percent here, so the length is measured instead: for each batch size (in powers of two) the
engine keeps the goodput (verified tokens per second of whole steps, everything included) of
each draft length it tried, runs the best one, and every few steps tries a neighbouring length
(hill climbing over 0, 1, 2, 3, 4, 6, 8). Length 0 is plain decoding, so when drafts do not pay
the engine stops drafting, and tries again now and then in case the workload changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# The draft lengths the adaptive length moves between; the last is the longest it chooses.
LENGTHS = (0, 1, 2, 3, 4, 6, 8)
MAX_ADAPTIVE_K = LENGTHS[-1]
_EXPLORE_EVERY = 8  # steps between tries of a neighbouring length
_SMOOTHING = 0.15  # weight of a new measurement in a length's running goodput
_MIN_TRIES = 3  # measurements of a neighbour before the engine may move to it
_MARGIN = 0.02  # a neighbour must be this much better to move


@dataclass
class _BatchSize:
    """What was measured for one batch-size bucket."""

    current: int = 2  # index into LENGTHS: start at 2 drafts, a good guess at one stream
    goodput: dict[int, float] = field(default_factory=dict)  # index -> tokens/s, smoothed
    tries: dict[int, int] = field(default_factory=dict)  # index -> measurements
    steps: int = 0


class AdaptiveDraftLength:
    """Chooses the draft length of each step (see the module docstring)."""

    def __init__(self) -> None:
        self._buckets: dict[int, _BatchSize] = {}
        self._last: Optional[tuple[_BatchSize, int]] = None  # this step's bucket and length

    def choose(self, num_seqs: int) -> int:
        """The draft length for a step of ``num_seqs`` decoding sequences that have drafts to
        offer."""
        bucket = self._buckets.setdefault(max(num_seqs, 1).bit_length(), _BatchSize())
        bucket.steps += 1
        index = bucket.current
        if bucket.steps % _EXPLORE_EVERY == 0:  # alternate below and above
            step = -1 if (bucket.steps // _EXPLORE_EVERY) % 2 else 1
            index = min(max(index + step, 0), len(LENGTHS) - 1)
        self._last = (bucket, index)
        return LENGTHS[index]

    def observe(self, tokens: float, seconds: float) -> None:
        """The step chosen last (decodes only) gave ``tokens`` verified tokens in ``seconds``."""
        if self._last is None or seconds <= 0:
            return
        bucket, index = self._last
        self._last = None
        rate = tokens / seconds
        old = bucket.goodput.get(index)
        bucket.goodput[index] = rate if old is None else old + _SMOOTHING * (rate - old)
        bucket.tries[index] = bucket.tries.get(index, 0) + 1
        best = bucket.goodput.get(bucket.current)
        for neighbour in (bucket.current - 1, bucket.current + 1):
            seen = bucket.goodput.get(neighbour)
            if (seen is not None and bucket.tries[neighbour] >= _MIN_TRIES
                    and (best is None or seen > best * (1 + _MARGIN))):
                bucket.current, best = neighbour, seen

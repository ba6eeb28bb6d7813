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
_FIRST_INTERVAL, _MAX_INTERVAL = 4, 64  # steps between tries of a neighbouring length
_SMOOTHING = 0.15  # weight of a new measurement in a length's running goodput
_MIN_TRIES = 3  # measurements of a neighbour before the engine may move to it
_MARGIN = 0.02  # a neighbour must be this much better to move


@dataclass
class _BatchSize:
    """What was measured for one batch-size bucket."""

    current: int  # index into LENGTHS
    goodput: dict[int, float] = field(default_factory=dict)  # index -> tokens/s, smoothed
    tries: dict[int, int] = field(default_factory=dict)  # index -> measurements
    interval: int = _FIRST_INTERVAL  # steps between tries of a neighbour
    until_try: int = _FIRST_INTERVAL
    tried_above: bool = False  # which neighbour the last try took


class AdaptiveDraftLength:
    """Chooses the draft length of each step (see the module docstring). One to three streams
    start at ``start`` (the drafter's ``adaptive_start``), larger batches at 0."""

    def __init__(self, start: int = 1) -> None:
        if start not in LENGTHS:
            raise ValueError(f"an adaptive start of {start} drafts is not one of {LENGTHS}")
        self._start = LENGTHS.index(start)
        self._buckets: dict[int, _BatchSize] = {}
        self._last: Optional[tuple[_BatchSize, int]] = None  # this step's bucket and length

    def choose(self, num_seqs: int) -> int:
        """The draft length for a step of ``num_seqs`` decoding sequences."""
        key = max(num_seqs, 1).bit_length()  # 1, 2-3, 4-7, ...
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _BatchSize(current=self._start if key <= 2 else 0)
        index = bucket.current
        bucket.until_try -= 1
        if bucket.until_try <= 0:  # try a neighbour: below and above in turn
            bucket.until_try = bucket.interval
            bucket.tried_above = not bucket.tried_above or index == 0
            index = min(max(index + (1 if bucket.tried_above else -1), 0), len(LENGTHS) - 1)
        self._last = (bucket, index)
        return LENGTHS[index]

    def skip(self) -> None:
        """This step is not the one chosen last: it must not be measured as such."""
        self._last = None

    def observe(self, tokens: float, seconds: float, drafted: bool = True) -> None:
        """The step chosen last gave ``tokens`` verified tokens in ``seconds`` (``drafted``:
        with some drafts). Only decode steps are observed; ``skip`` says that the next step was
        not chosen here. A step that allowed drafts but had none (prompt lookup found no match)
        ran as plain decoding whatever the length: it is not measured as that length's, or the
        stretches of a workload without matches would pull every length towards plain decoding
        (a length tried in one looked worse than one measured in a stretch with matches)."""
        if self._last is None or seconds <= 0:
            return
        bucket, index = self._last
        self._last = None
        if not drafted and LENGTHS[index]:
            return
        rate = tokens / seconds
        old = bucket.goodput.get(index)
        bucket.goodput[index] = rate if old is None else old + _SMOOTHING * (rate - old)
        bucket.tries[index] = bucket.tries.get(index, 0) + 1
        if index == bucket.current:
            return
        best = bucket.goodput.get(bucket.current)
        better = best is None or bucket.goodput[index] > best * (1 + _MARGIN)
        if bucket.tries[index] >= _MIN_TRIES and better:
            bucket.current = index  # moved: look around the new length often again
            bucket.interval = bucket.until_try = _FIRST_INTERVAL
        elif best is not None and bucket.goodput[index] < best:
            bucket.interval = min(2 * bucket.interval, _MAX_INTERVAL)

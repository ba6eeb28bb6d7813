"""The adaptive draft length (``spec_draft_length=0``): the draft length that gives the most
tokens per second, found by measuring while serving.

What a draft costs depends on the machine, the model, the opt level and the batch (on a CPU,
one stream reads every weight for one token and a few more tokens cost little; a full batch is
compute-bound and every extra token costs as much), and what it earns depends on the workload
(copying a given text accepts most drafts, free chat few). A model of either was wrong by tens
of percent here, so both are measured, apart:

- What a length earns: the acceptance at each draft position, pooled over every drafted step.
  A step that drafted k tokens also says what any shorter length would have yielded (the drafts
  it accepted up to there), so the lengths below the current one need no tries and share one
  estimate: a run of easy or hard text moves them all alike instead of whichever length was
  measured in it. A position deeper than any drafted lately starts from the geometric
  extrapolation of the ones before it (``_PRIOR``).
- What a length costs: its seconds a sequence-step beside the current length's, per batch size
  (in powers of two). This is what the engine tries neighbouring lengths for: every few steps it
  runs one (hill climbing over 0, 1, 2, 3, 4, 6, 8), takes the step's time over the current
  length's running time (so a machine that slows down or speeds up between tries moves neither
  length), and moves when the neighbour's goodput (expected tokens over seconds) is better.

Length 0 is plain decoding, so when drafts do not pay the engine stops drafting, and tries again
now and then in case the workload changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# The draft lengths the adaptive length moves between; the last is the longest it chooses.
LENGTHS = (0, 1, 2, 3, 4, 6, 8)
MAX_ADAPTIVE_K = LENGTHS[-1]
_FIRST_INTERVAL, _MAX_INTERVAL = 4, 64  # steps between tries of a neighbouring length
_SMOOTHING = 0.15  # weight of a new measurement in a running time
_DECAY = 0.99  # per drafted step, the weight of a position's earlier acceptance counts
_PRIOR = 8.0  # pseudo-samples of a position's extrapolated acceptance (see ``_Acceptance``)
_MIN_TRIES = 3  # measurements of a neighbour before the engine may move to it
_MARGIN = 0.02  # a neighbour must be this much better to move


class _Acceptance:
    """Per draft position: the sequence-steps that allowed a draft there and how many of those
    accepted it, decayed by ``_DECAY`` each step that has samples of that position (so a
    position drafted only in tries keeps what they measured)."""

    def __init__(self) -> None:
        self.allowed = [0.0] * MAX_ADAPTIVE_K
        self.accepted = [0.0] * MAX_ADAPTIVE_K

    def add(self, outcomes: list[tuple[int, int]]) -> None:
        """One step's ``(allowed depth, accepted drafts)`` per decoding sequence."""
        deepest = max((depth for depth, _ in outcomes), default=0)
        for i in range(deepest):
            self.allowed[i] *= _DECAY
            self.accepted[i] *= _DECAY
        for depth, accepted in outcomes:
            for i in range(depth):
                self.allowed[i] += 1
                self.accepted[i] += i < accepted

    def tokens(self, k: int) -> Optional[float]:
        """Expected tokens a sequence-step at length ``k`` yields (its accepted drafts and the
        model's own token), or None before any draft was measured. Each position's rate (the
        share of sequence-steps that accepted at least that many drafts) is blended with
        ``_PRIOR`` pseudo-samples of the previous position's rate times the ratio of the two
        before (the first position's rate itself for the second), and is at most the previous
        one's: a position sampled a few times in tries is not taken at its few samples' word,
        one never sampled is the extrapolation, and one sampled in every step barely moves."""
        if k == 0:
            return 1.0
        if not self.allowed[0]:
            return None
        rates = [self.accepted[0] / self.allowed[0]]
        for i in range(1, k):
            ratio = rates[-1] / rates[-2] if i >= 2 and rates[-2] else rates[0]
            prior = rates[-1] * min(ratio, 1.0)
            rate = (self.accepted[i] + _PRIOR * prior) / (self.allowed[i] + _PRIOR)
            rates.append(min(rate, rates[-1]))  # (a deeper draft needs the one before it)
        return 1 + sum(rates)


@dataclass
class _BatchSize:
    """What was measured for one batch-size bucket."""

    current: int  # index into LENGTHS
    seconds: Optional[float] = None  # the current length's per sequence-step, smoothed
    relative: dict[int, float] = field(default_factory=dict)  # index -> seconds over current's
    tries: dict[int, int] = field(default_factory=dict)  # index -> measurements
    interval: int = _FIRST_INTERVAL  # steps between tries of a neighbour
    until_try: int = _FIRST_INTERVAL
    tried_above: bool = False  # which neighbour the last try took

    def move(self, index: int) -> None:
        """Make ``LENGTHS[index]`` current: the other lengths' times are taken relative to it."""
        factor = self.relative.pop(index)
        self.relative = {i: r / factor for i, r in self.relative.items()}
        self.relative[self.current] = 1 / factor
        self.tries[self.current] = 0  # (measured as the current, never beside the new one)
        self.seconds = None if self.seconds is None else self.seconds * factor
        self.current = index
        self.interval = self.until_try = _FIRST_INTERVAL  # look around the new length often


class AdaptiveDraftLength:
    """Chooses the draft length of each step (see the module docstring). One to three streams
    start at ``start`` (the drafter's ``adaptive_start``), larger batches at 0."""

    def __init__(self, start: int = 1) -> None:
        if start not in LENGTHS:
            raise ValueError(f"an adaptive start of {start} drafts is not one of {LENGTHS}")
        self._start = LENGTHS.index(start)
        self._buckets: dict[int, _BatchSize] = {}
        self._acceptance = _Acceptance()

    def choose(self, num_seqs: int) -> int:
        """The draft length for a step of ``num_seqs`` decoding sequences (``observe`` takes
        both back with the step's measurements)."""
        bucket = self._bucket(num_seqs)
        index = bucket.current
        bucket.until_try -= 1
        if bucket.until_try <= 0 and bucket.seconds is not None:  # try a neighbour, in turn
            bucket.until_try = bucket.interval
            bucket.tried_above = not bucket.tried_above or index == 0
            index = min(max(index + (1 if bucket.tried_above else -1), 0), len(LENGTHS) - 1)
        return LENGTHS[index]

    def observe(self, num_seqs: int, k: int, seconds: float, outcomes: list[tuple[int, int]],
                drafted: bool = True) -> None:
        """A decode step whose length ``k`` was chosen for ``num_seqs`` sequences took
        ``seconds``; ``outcomes``: per decoding sequence, the drafts the step allowed it (the
        length, or less near its length limits) and how many it accepted; ``drafted``: some
        sequence had drafts. A step that allowed drafts but had none (prompt lookup found no
        match) ran as plain decoding whatever the length: it measures neither, or the stretches
        of a workload without matches would pull every length towards plain decoding."""
        if seconds <= 0 or not outcomes or (k and not drafted):
            return
        bucket, index = self._bucket(num_seqs), LENGTHS.index(k)
        self._acceptance.add(outcomes)
        per_seq = seconds / len(outcomes)
        if index == bucket.current:
            old = bucket.seconds
            bucket.seconds = per_seq if old is None else old + _SMOOTHING * (per_seq - old)
            return
        if bucket.seconds is None:  # (a neighbour is tried once the current length has a time)
            return
        relative = per_seq / bucket.seconds
        old = bucket.relative.get(index)
        bucket.relative[index] = relative if old is None else old + _SMOOTHING * (relative - old)
        bucket.tries[index] = bucket.tries.get(index, 0) + 1
        gain = self._gain(bucket, index)
        if gain is None:
            return
        if bucket.tries[index] >= _MIN_TRIES and gain > 1 + _MARGIN:
            bucket.move(index)
        elif gain < 1:
            bucket.interval = min(2 * bucket.interval, _MAX_INTERVAL)

    def _bucket(self, num_seqs: int) -> _BatchSize:
        key = max(num_seqs, 1).bit_length()  # 1, 2-3, 4-7, ...
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _BatchSize(current=self._start if key <= 2 else 0)
        return bucket

    def _gain(self, bucket: _BatchSize, index: int) -> Optional[float]:
        """The expected goodput of ``LENGTHS[index]`` over the current length's, once known."""
        mine = self._acceptance.tokens(LENGTHS[index])
        current = self._acceptance.tokens(LENGTHS[bucket.current])
        if mine is None or current is None:
            return None
        return mine / current / bucket.relative[index]

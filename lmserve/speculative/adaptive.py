"""The adaptive draft length (``spec_draft_length=0``): the length with the most tokens a
second, measured while serving. What a length earns is the acceptance at each draft position,
pooled over every drafted step; what it costs is its step time beside the current length's, per
batch size, from tries of its neighbours and of plain decoding (hill climbing), spaced by what
they cost. docs/speculative.md ("The adaptive length") tells the whole rule and why.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

from lmserve.config import MAX_ADAPTIVE_K

# The draft lengths the adaptive length moves between; the last is the longest it chooses.
LENGTHS = (0, 1, 2, 3, 4, 6, MAX_ADAPTIVE_K)
# Steps between tries of another length: at first, and at most as it doubles while
# tries lose; longer where tries cost more than _TRY_SHARE of the time, up to _LONGEST_INTERVAL
_FIRST_INTERVAL, _MAX_INTERVAL = 4, 64
_TRY_SHARE = 0.02
# (a try that has a draft model catch up on four long prompts costs some 70 plain steps: at 512
# steps apart such tries took 10% of the time)
_LONGEST_INTERVAL = 4096
_RECENT = 15  # the current length's latest step times, whose median is its time
_TRIES_KEPT = 5  # a tried length's latest relative times, whose median is its relative time
_DECAY = 0.99  # per drafted step, the weight of a position's earlier acceptance counts
_PRIOR = 8.0  # pseudo-samples of a position's extrapolated acceptance (see ``_Acceptance``)
_MIN_TRIES = 3  # measurements of a tried length before the engine may move to it
_MARGIN = 0.02  # a tried length must be this much better to move
_MIN_BEHIND = 64  # tokens a try's catch-up must have run to time one (fewer: noise)


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


@dataclass(frozen=True)
class DraftChoice:
    """A step's draft length as chosen, handed back with the step's measurements."""

    num_seqs: int  # decoding sequences it was chosen for
    length: int
    timed: bool = True  # False: the first step of a try (it pays for the switch)


@dataclass
class _BatchSize:
    """What was measured for one batch-size bucket. Times are medians of the latest steps: a
    step now and then takes several times as long (a page fault, another process), and one
    such step as a try would decide for a long time."""

    current: int  # index into LENGTHS
    # The current length's latest seconds per sequence-step, and per other length its latest
    # tries' seconds over the current length's time then
    recent: deque = field(default_factory=lambda: deque(maxlen=_RECENT))
    relative: dict[int, deque] = field(default_factory=dict)
    interval: int = _FIRST_INTERVAL  # steps between tries of another length
    until_try: int = _FIRST_INTERVAL
    turn: int = 0  # tries made: which of ``candidates()`` the next one takes
    # The try under way's untimed steps: their seconds a sequence-step, how many were measured
    switch_seconds: float = 0.0
    switch_steps: int = 0
    switch_behind: int = 0  # the tokens the drafter was behind by in them
    since_try: int = 0  # steps since its latest try
    try_costs: deque = field(default_factory=lambda: deque(maxlen=_TRIES_KEPT))  # see _try_cost
    moved: bool = False  # whether its own tries moved its length
    followed: bool = False  # whether it took its length and spacing from a measured batch size

    def seconds(self) -> Optional[float]:
        return median(self.recent) if self.recent else None

    def candidates(self) -> list[int]:
        """The lengths (indices) tried beside the current one, in turn: the one above, the one
        below, and plain decoding where it is neither."""
        above_below_plain = (self.current + 1, self.current - 1, 0)
        return [i for i in dict.fromkeys(above_below_plain) if 0 <= i < len(LENGTHS) and i != self.current]

    def relative_seconds(self, index: int) -> Optional[float]:
        tries = self.relative.get(index)
        return median(tries) if tries else None

    def move(self, index: int) -> None:
        """Make ``LENGTHS[index]`` current: the other lengths' times are taken relative to it,
        and the one it leaves (measured as the current, never beside the new one) must be
        tried again."""
        factor = self.relative_seconds(index)
        del self.relative[index]
        self.relative = {i: deque((r / factor for r in tries), maxlen=_TRIES_KEPT)
                         for i, tries in self.relative.items()}
        self.recent = deque((t * factor for t in self.recent), maxlen=_RECENT)
        self.current, self.moved = index, True
        self.interval = self.until_try = _FIRST_INTERVAL  # look around the new length often
        self.try_costs.clear()


@dataclass
class _Try:
    """A try under way: the bucket's key, the length's index, untimed steps still to run."""

    key: int
    index: int
    untimed: int


class AdaptiveDraftLength:
    """Chooses the draft length of each step (see the module docstring). One to three streams
    start at ``start`` (the drafter's ``adaptive_start``), larger batches at 0. A try runs
    ``switch_steps`` untimed steps before its timed one: one per pipeline stage, whose batches
    hold different sequences, each paying for its own switch."""

    def __init__(self, start: int = 1, switch_steps: int = 1) -> None:
        if start not in LENGTHS:
            raise ValueError(f"an adaptive start of {start} drafts is not one of {LENGTHS}")
        self._start = LENGTHS.index(start)
        self._switch_steps = switch_steps
        self._buckets: dict[int, _BatchSize] = {}
        self._acceptance = _Acceptance()
        self._trying: Optional[_Try] = None
        # The latest tries' seconds a token of the drafter's catch-up (see ``_catch_up_steps``)
        self._catch_up_per_token: deque = deque(maxlen=_TRIES_KEPT)

    def choose(self, num_seqs: int, behind: int = 0) -> DraftChoice:
        """The draft length for a step of ``num_seqs`` decoding sequences, for which the
        drafter has ``behind`` tokens to run before it can draft (``observe`` takes the choice
        back with the step's measurements)."""
        key = _key(num_seqs)
        bucket, trying = self._bucket(key), self._trying
        if len(bucket.recent) < _RECENT and not bucket.moved and (trying is None or
                                                                 trying.key != key):
            bucket = self._follow(key, bucket)
        if trying is not None and trying.key == key:
            if trying.untimed:  # (another pipeline stage's batch, with its own catch-up)
                trying.untimed -= 1
                bucket.switch_behind += behind if LENGTHS[trying.index] else 0
                return DraftChoice(num_seqs, LENGTHS[trying.index], timed=False)
            self._trying = None
            return DraftChoice(num_seqs, LENGTHS[trying.index])
        self._trying = None  # (a step of another batch size between: its sequences ran plain)
        index = bucket.current
        bucket.until_try -= 1
        bucket.since_try += 1
        if bucket.until_try <= 0 and bucket.recent:  # try another length, in turn
            candidates = bucket.candidates()
            index = candidates[bucket.turn % len(candidates)]
            if LENGTHS[index] and self._catch_up_steps(bucket, num_seqs, behind) > \
                    _TRY_SHARE * bucket.since_try:
                return DraftChoice(num_seqs, LENGTHS[bucket.current])  # (not yet)
            bucket.until_try, bucket.since_try = bucket.interval, 0
            bucket.turn += 1
            self._trying = _Try(key, index, self._switch_steps - 1)
            bucket.switch_seconds, bucket.switch_steps = 0.0, 0
            bucket.switch_behind = behind if LENGTHS[index] else 0
            return DraftChoice(num_seqs, LENGTHS[index], timed=False)
        return DraftChoice(num_seqs, LENGTHS[index])

    def skip(self) -> None:
        """A step with no choice (prefill chunks share it): its decoding sequences run plain,
        so a try under way would time a switch again; it is dropped."""
        self._trying = None

    def observe(self, choice: DraftChoice, seconds: float, outcomes: list[tuple[int, int]],
                drafted: bool = True, steps: int = 1) -> None:
        """A decode step run at ``choice`` took ``seconds``; ``outcomes``: per decoding
        sequence, the drafts the step allowed it (the length, or less near its length limits)
        and how many it accepted; ``drafted``: some sequence had drafts. A step that allowed
        drafts but had none (prompt lookup found no match) ran as plain decoding whatever the
        length: it measures neither, or the stretches of a workload without matches would
        pull every length towards plain decoding. ``steps``: the plain steps it stands for (a
        multi-step run of that many tokens, ``seconds`` being a token's), which count towards
        the next try as plain steps do."""
        if seconds <= 0 or not outcomes or (choice.length and not drafted):
            return
        self._acceptance.add(outcomes)
        bucket, index = self._bucket(_key(choice.num_seqs)), LENGTHS.index(choice.length)
        if choice.timed and index == bucket.current:
            bucket.until_try -= steps - 1
            bucket.since_try += steps - 1
        per_seq = seconds / len(outcomes)
        if not choice.timed:
            bucket.switch_seconds += per_seq
            bucket.switch_steps += 1
            return
        if index == bucket.current:
            bucket.recent.append(per_seq)
            return
        if not bucket.recent:  # (a length is tried once the current length has a time)
            return
        if bucket.switch_behind >= _MIN_BEHIND:
            extra = (bucket.switch_seconds - bucket.switch_steps * per_seq) * len(outcomes)
            self._catch_up_per_token.append(max(extra, 0.0) / bucket.switch_behind)
        current_seconds = bucket.seconds()
        assert current_seconds is not None  # (bucket.recent is not empty: checked above)
        tries = bucket.relative.setdefault(index, deque(maxlen=_TRIES_KEPT))
        tries.append(per_seq / current_seconds)
        gain = self._gain(bucket, index)
        if gain is None:
            return
        bucket.try_costs.append(self._try_cost(bucket, index, per_seq))
        # (known where ``gain`` is: the same acceptance, and ``tries`` is not empty)
        latest_gain = self._gain(bucket, index, tries[-1])
        assert latest_gain is not None
        if gain > 1 + _MARGIN and len(tries) >= _MIN_TRIES:
            bucket.move(index)
            self._trying = None
        elif latest_gain > 1 + _MARGIN:
            # This try won, whatever the earlier ones said: tries resume every few steps, so
            # that a change of workload is confirmed (or not) soon, however far apart they were.
            bucket.interval = bucket.until_try = _FIRST_INTERVAL
        elif gain < 1 and (len(tries) >= _MIN_TRIES or bucket.followed):
            bucket.interval = min(2 * bucket.interval, _MAX_INTERVAL)
            if self._is_best(bucket):
                # Spaced so that tries cost at most _TRY_SHARE of the time, going by the median
                # of the latest tries' costs (a slow step does not space them for long).
                cost = median(bucket.try_costs)
                bucket.interval = max(bucket.interval, min(math.ceil(cost / _TRY_SHARE),
                                                           _LONGEST_INTERVAL))
                bucket.until_try = max(bucket.until_try, bucket.interval)

    def _is_best(self, bucket: _BatchSize) -> bool:
        """Whether the current length beats each length it tries as measured so far."""
        gains = [self._gain(bucket, i) for i in bucket.candidates()]
        return all(g is not None and g < 1 for g in gains)

    def _catch_up_steps(self, bucket: _BatchSize, num_seqs: int, behind: int) -> float:
        """What the drafter's catch-up on ``behind`` tokens would cost, in steps of the
        current length, going by the catch-ups of the latest tries (0 before any)."""
        if not self._catch_up_per_token:
            return 0.0
        seconds = bucket.seconds()
        assert seconds is not None  # (called for a bucket with recent steps only)
        return behind * median(self._catch_up_per_token) / (seconds * num_seqs)

    def _try_cost(self, bucket: _BatchSize, index: int, per_seq: float) -> float:
        """What the try of ``LENGTHS[index]`` just measured (its timed step took ``per_seq`` a
        sequence-step) cost, in steps of the current length: its steps' time (the switch's
        too) over what the current length takes for the tokens they are expected to yield. A
        few percent of a step between neighbouring lengths that both pay; two or three steps to
        draft at all in a full, compute-bound batch (its verify costs twice a plain step, and
        drafters on hidden states first catch up on the tokens they skipped)."""
        # (called once ``_gain`` is known: both lengths' tokens, and the current length's time)
        mine, current = self._acceptance.tokens(LENGTHS[index]), self._acceptance.tokens(
            LENGTHS[bucket.current])
        seconds = bucket.seconds()
        assert mine is not None and current is not None and seconds is not None
        tokens = mine / current
        return (bucket.switch_seconds + per_seq) / seconds - (
            bucket.switch_steps + 1) * tokens

    def _bucket(self, key: int) -> _BatchSize:
        bucket = self._buckets.get(key)
        return self._follow(key, None) if bucket is None else bucket

    def _first_length(self, key: int) -> int:
        """Where a batch size starts: one to three streams at ``start``, larger batches at 0."""
        return self._start if key <= 2 else 0

    def _follow(self, key: int, bucket: Optional[_BatchSize]) -> _BatchSize:
        """A batch size with too few steps of its own for a median, which its own tries have
        not moved (a batch's tail as its requests finish: a few steps a wave), does not draft
        where the nearest batch size that has one (the larger of two as near) settled on plain
        decoding, and starts at its own start otherwise. Left at the draft model's start, every
        tail of 4 streams drafted 8 tokens a step where the full batch had measured plain
        decoding 1.3-1.4x faster (the built-in model drafting for itself at the default level);
        taking a drafting batch's length instead, the tails of 4 streams drafted 3 at the O0
        target, where 8 pays most at one or two streams."""
        measured = [k for k, b in self._buckets.items() if len(b.recent) == _RECENT]
        nearest = self._buckets[min(measured, key=lambda k: (abs(k - key), -k))] \
            if measured else None
        plain = nearest is not None and nearest.current == 0
        guess = 0 if plain else self._first_length(key)
        if bucket is None or guess != bucket.current:
            bucket = self._buckets[key] = _BatchSize(current=guess)
            if plain:
                assert nearest is not None  # (``plain`` implies it)
                # Tried as seldom as the nearest one, which found plain decoding the best, and
                # once a try loses, spaced by what its own tries cost (a draft model's catch-up
                # on every sequence's prompt costs more in a larger batch).
                bucket.interval = bucket.until_try = nearest.interval
                bucket.followed = True
        return bucket

    def _gain(self, bucket: _BatchSize, index: int, relative: Optional[float] = None
              ) -> Optional[float]:
        """The expected goodput of ``LENGTHS[index]`` over the current length's, once known, at
        its tries' median relative time (or at ``relative``)."""
        mine = self._acceptance.tokens(LENGTHS[index])
        current = self._acceptance.tokens(LENGTHS[bucket.current])
        if mine is None or current is None or index not in bucket.relative:
            return None
        seconds = relative or bucket.relative_seconds(index)
        assert seconds is not None  # (index is in bucket.relative, whose deques are never empty)
        return mine / current / seconds


def _key(num_seqs: int) -> int:
    """The batch-size bucket of ``num_seqs`` sequences: 1, 2-3, 4-7, ..."""
    return max(num_seqs, 1).bit_length()

"""The adaptive draft length (``spec_draft_length=0``): each step, as many drafts per sequence
as pay for themselves.

Two things are measured while serving. The time of a decode step as a function of the tokens it
runs, ``T(n) = t0 + t1 * n``, fitted by least squares with forgetting over recent steps (on a
CPU, one stream reads every weight for one token and a few more tokens are almost free; a full
batch is compute-bound and every extra token costs). And each sequence's acceptance rate ``a``
(the chance that a draft is accepted given the ones before it were), from its own verified
drafts with the engine-wide rate as the prior; a sequence that stops drafting drifts back to the
prior, so it is tried again later.

With ``k`` drafts a sequence expects ``1 + a + a^2 + ... + a^k`` tokens from a step, so its
i-th draft adds ``a^i``. The step's goodput is ``G = E / T(n)``: expected tokens ``E`` over time.
Draft slots are handed out best first while a slot's expected tokens beat what its compute
earns at the current goodput (``a^i > t1 * G``); when none does, the step is a plain decode.
"""

from __future__ import annotations

import heapq
import weakref

# The longest draft the adaptive length may choose.
MAX_ADAPTIVE_K = 8
# A step of n tokens is assumed to cost (1 + n / 32) times a one-token step until steps of
# different sizes have been timed.
_PRIOR_TOKEN_COST = 1 / 32
_STEP_DECAY = 0.98  # per timed step: about the last 50 steps count
_SEQ_DECAY = 0.9  # per verification or idle step of a sequence
_PRIOR_WEIGHT = 2.0  # the engine-wide rate counts as this many drafts in each sequence's rate


class StepCost:
    """``T(n) = t0 + t1 * n`` in seconds, fitted to recent steps (weighted least squares)."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = _STEP_DECAY
        self._w = self._w * d + 1
        self._x = self._x * d + num_tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + num_tokens * num_tokens
        self._xy = self._xy * d + num_tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        """(t0, t1); before any step, (1, prior) in units of a one-token step."""
        if self._w == 0:
            return 1.0, _PRIOR_TOKEN_COST
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 1.0:  # steps of different sizes seen: fit the slope
            t1 = max((self._xy / self._w - mx * my) / var, 0.0)
            t0 = max(my - t1 * mx, 1e-9)
            return t0, t1
        t0 = my / (1 + _PRIOR_TOKEN_COST * mx)
        return t0, _PRIOR_TOKEN_COST * t0


class AcceptanceRate:
    """Accepted over verified drafts, decayed, with a prior."""

    def __init__(self, prior: float = 0.5, weight: float = 4.0) -> None:
        self.accepted = prior * weight
        self.trials = weight

    def observe(self, drafted: int, accepted: int, decay: float) -> None:
        # Drafts after the first rejected one were never judged on their own.
        self.accepted = self.accepted * decay + accepted
        self.trials = self.trials * decay + accepted + (1 if accepted < drafted else 0)

    def rate(self, prior: float = 0.0, weight: float = 0.0) -> float:
        return (self.accepted + prior * weight) / max(self.trials + weight, 1e-9)


class AdaptiveDraftLength:
    """Chooses every decoding sequence's draft length for one step (see the module docstring)."""

    def __init__(self) -> None:
        self.cost = StepCost()
        self.overall = AcceptanceRate()
        # Each sequence's own rate, forgotten with the sequence.
        self._rates: weakref.WeakKeyDictionary[object, AcceptanceRate] = weakref.WeakKeyDictionary()

    def choose(self, seqs: list[object], caps: list[int]) -> list[int]:
        """Draft lengths for the decoding sequences ``seqs``, each at most its cap (what the
        drafter offers and the length limits allow)."""
        t0, t1 = self.cost.coefficients()
        prior = self.overall.rate()
        rates = []
        for seq in seqs:
            seq_rate = self._rates.get(seq)
            rates.append(seq_rate.rate(prior, _PRIOR_WEIGHT) if seq_rate else prior)
        lengths = [0] * len(seqs)
        expected = float(len(seqs))  # each sequence's own next token
        num_tokens = len(seqs)
        # Best slot first: a sequence's next draft adds rate^(drafts so far + 1).
        heap = [(-rates[i], i) for i in range(len(seqs)) if caps[i] > 0 and rates[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            if -neg_gain <= t1 * expected / (t0 + t1 * num_tokens):
                break
            lengths[i] += 1
            expected -= neg_gain
            num_tokens += 1
            if lengths[i] < caps[i]:
                heapq.heappush(heap, (neg_gain * rates[i], i))
        return lengths

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step's size and time."""
        self.cost.observe(num_tokens, seconds)

    def observe_verify(self, seq: object, drafted: int, accepted: int) -> None:
        """A sequence's verified drafts (``drafted`` 0: it did not draft this step)."""
        seq_rate = self._rates.setdefault(seq, AcceptanceRate(prior=0.0, weight=0.0))
        seq_rate.observe(drafted, accepted, _SEQ_DECAY)
        if drafted:
            self.overall.observe(drafted, accepted, _STEP_DECAY)

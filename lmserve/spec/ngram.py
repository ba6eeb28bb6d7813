"""Prompt-lookup drafting: no extra model, drafts copied from the sequence's own tokens.

When a sequence's last ``n`` tokens occurred before (in its prompt or its output), the tokens
that followed them there are a good guess for what follows now: summaries, extractions,
rewrites and code edits copy long runs of their input. The longest suffix of ``max_n`` down to
``min_n`` tokens with an earlier occurrence wins, and its latest occurrence is used.
"""

from __future__ import annotations

import numpy as np

from lmserve.request import Sequence
from lmserve.scheduler import Batch


class NgramDrafter:
    """Proposes up to ``k`` tokens per sequence by prompt lookup; deterministic (q = 1 on its
    token), so verification needs no draft probabilities."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._proposals: dict[Sequence, list[int]] = {}  # this step's, from ``offer``

    def offer(self, seq: Sequence, cap: int) -> int:
        """Look the drafts up now (cheap); their number is the offer."""
        proposal = propose_ngram(_tokens_array(seq), cap, self.min_n, self.max_n)
        if proposal:
            self._proposals[seq] = proposal
        return len(proposal)

    def propose(self, batch: Batch) -> None:
        for c in batch.chunks:
            if c.num_lookahead:
                c.draft_token_ids = self._proposals[c.seq][: c.num_lookahead]
        self._proposals = {}


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The up to ``k`` tokens after the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``max_n`` down to ``min_n`` tokens; [] when there is none.

    One pass over the tokens finds the earlier occurrences of the last token; the match is then
    extended backwards at all of them at once (a step costs microseconds, not a scan per n).
    """
    length = len(tokens)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # earlier last tokens
    if len(ends) == 0:
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # suffix tokens matched at each
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, max_n):
        at = ends - back
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    longest = int(matched.max())
    if longest < min_n:
        return []
    start = int(ends[np.flatnonzero(matched == longest)[-1]]) + 1
    return tokens[start : start + k].tolist()


def _tokens_array(seq: Sequence) -> np.ndarray:
    """``seq.token_ids`` as an int64 array, grown in place as the sequence grows (a per-step
    conversion of the whole list would cost more than the lookup)."""
    buf, used = seq.draft_state if seq.draft_state is not None else (np.empty(0, np.int64), 0)
    tokens = seq.token_ids
    if len(tokens) < used or (used and buf[used - 1] != tokens[used - 1]):
        used = 0  # the tokens changed behind our back (not expected): start over
    if len(tokens) > len(buf):
        grown = np.empty(max(2 * len(buf), len(tokens), 64), np.int64)
        grown[:used] = buf[:used]
        buf = grown
    buf[used : len(tokens)] = tokens[used:]
    seq.draft_state = (buf, len(tokens))
    return buf[: len(tokens)]

"""Prompt-lookup drafting: no extra model, drafts copied from the sequence's own tokens.

When a sequence's last ``n`` tokens occurred before (in its prompt or its output), the tokens
that followed them there are a good guess for what follows now: summaries, extractions,
rewrites and code edits copy long runs of their input. The longest suffix of ``max_n`` down to
``min_n`` tokens with an earlier occurrence wins, and its latest occurrence is used. With a tree
width ``w`` > 1, the ``w`` best occurrences (longest match, then latest) with different
continuations are drafted together as a tree (shared beginnings once).

How far to trust a match grows with its length: a match of ``m`` tokens drafts at most
``2m - 3`` (``draft_depth``). Replaying the built-in model's greedy answers to the benchmark's
input-grounded prompts, the first draft after a 2-token match was right 53% of the time and
the fourth 24%, after a 4-token match 87% and 55%, after 6 tokens or more 89-96% and 62-86%.
On a CPU every drafted token costs a share of a step, so short matches draft little and long
ones deep: in that replay, with a drafted token costing a quarter of a step, the rule gave 4-5%
more tokens per unit of step cost than a fixed 4 drafts after every match of 2-4 tokens, and
12-14% more than a fixed 8.
"""

from __future__ import annotations

import numpy as np

from lmserve.request import Sequence
from lmserve.scheduler import Batch, ScheduledChunk
from lmserve.speculative.tree import DraftTree


class NgramDrafter:
    """Proposes up to ``k`` tokens deep per sequence by prompt lookup, ``width`` continuations;
    deterministic (q = 1 on its tokens), so verification needs no draft probabilities."""

    # It drafts little after a short match (``draft_depth``), so a deep cap costs little where
    # it is unsure. Between 4, 6 and 8 the goodputs differ by a few percent, so the adaptive
    # length stays near its start: from 8 it ran at k=8's speed (1.44x plain decoding, 3.83
    # tokens a step), from 4 at 0.89x of k=8's (3.17), from 2 at 1.26x plain decoding
    # (grounded prompts of benchmarks/speculative.py, c=1, Zen 4, the estimate before
    # 2026-12-05; since then from 8: 1.37-1.54x, 3.60 tokens a step).
    adaptive_start = 8

    def __init__(self, width: int = 1, min_n: int = 2, max_n: int = 6) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.width = width
        self.min_n = min_n
        self.max_n = max_n
        self._proposals: dict[Sequence, DraftTree] = {}  # this step's, from ``offer``

    def offer(self, seq: Sequence, cap: int) -> int:
        """Look the drafts up now (cheap); their depth is the offer."""
        tree = propose_ngram(_tokens_array(seq), cap, self.min_n, self.max_n, self.width)
        if len(tree):
            self._proposals[seq] = tree
        return max((tree.depth(i) for i in range(len(tree))), default=0)

    def num_nodes(self, seq: Sequence, depth: int) -> int:
        """The looked-up tree's nodes down to ``depth``."""
        tree = self._proposals.get(seq)
        return 0 if tree is None else sum(tree.depth(i) <= depth for i in range(len(tree)))

    @staticmethod
    def behind(seq: Sequence) -> int:
        return 0  # (no state to catch up)

    def propose(self, batch: Batch, depths: dict[ScheduledChunk, int]) -> None:
        for c, depth in depths.items():
            c.draft = self._proposals[c.seq].truncated(c.num_lookahead, depth)
        self._proposals = {}


def draft_depth(matched: int) -> int:
    """Most tokens drafted after a match of ``matched`` tokens (see the module docstring)."""
    return max(1, 2 * matched - 3)


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int, width: int = 1) -> DraftTree:
    """The up to ``k`` tokens (``draft_depth`` of the match at most) after the latest earlier
    occurrence of the longest suffix of ``tokens`` of ``max_n`` down to ``min_n`` tokens (then
    those after the next best occurrences, up to ``width`` different continuations); an empty
    tree when there is none.

    One pass over the tokens finds the earlier occurrences of the last token; the match is then
    extended backwards at all of them at once (a step costs microseconds, not a scan per n).
    """
    tree, length = DraftTree(), len(tokens)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # earlier last tokens
    if len(ends) == 0 or k == 0:
        return tree
    matched = np.ones(len(ends), dtype=np.int64)  # suffix tokens matched at each
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, max_n):
        at = ends - back
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    added = 0  # continuations that added nodes (not already in the tree)
    for i in np.lexsort((-ends, -matched)):  # longest match first, then latest
        if matched[i] < min_n or added == width:
            break
        size, node = len(tree), -1
        depth = min(k, draft_depth(int(matched[i])))
        for token in tokens[ends[i] + 1 : ends[i] + 1 + depth].tolist():
            node = tree.add(node, token)
        added += len(tree) > size
    return tree


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

"""Per-sequence grammar state and the step's token masks.

Each constrained sequence holds a ``SequenceGrammar``, advanced by every token it keeps (in the
output processor). Before sampling, ``fill_bitmask`` writes the allowed tokens of every
constrained row of the step; with speculative decoding a sequence has a row per draft node, the
position after the path of drafts to it, and the matcher walks each path and rolls back after
(a draft the grammar refuses makes its row and those below it moot: the target's masked sample
can never accept it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from lmserve.errors import InvalidRequestError
from lmserve.structured.xgrammar_lib import import_xgrammar


class SequenceGrammar:
    """A sequence's matcher: which tokens its grammar allows next. ``origin`` names the request
    field of the constraint, for errors."""

    def __init__(self, compiled: Any, origin: str = "structured_outputs") -> None:
        xgr = import_xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self.origin = origin

    def accept(self, token_id: int) -> None:
        """Advance by a token the sequence kept. The masks only let through allowed tokens, so a
        refused one means the grammar allowed none (a dead end: ``InvalidRequestError``, e.g. a
        ``const`` whose characters no token of this vocabulary spells); anything else is a bug
        (``RuntimeError``)."""
        if self._matcher.accept_token(token_id):
            return
        bitmask = import_xgrammar().allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise InvalidRequestError(f"{self.origin}: no token of this model's vocabulary can "
                                      f"continue the output here, so the constraint cannot be "
                                      f"met", self.origin)
        raise RuntimeError(f"token {token_id} breaks the request's grammar")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, first_row: int, paths: Sequence[Sequence[int]]) -> None:
        """Fill ``bitmask`` rows ``first_row + i``: the tokens allowed after drafts ``paths[i]``.

        Each path re-walks only what differs from the path before it (nothing for a chain).
        Rows whose path the grammar refuses, or that follow the grammar's end (a drafted stop
        token), are left as they are: no token can be accepted there.
        """
        walked: list[int] = []
        try:
            for i, path in enumerate(paths):
                common = 0
                while common < min(len(walked), len(path)) and walked[common] == path[common]:
                    common += 1
                if len(walked) > common:
                    self._matcher.rollback(len(walked) - common)
                    del walked[common:]
                for token_id in path[common:]:
                    if not self._matcher.accept_token(token_id):
                        break
                    walked.append(token_id)
                if len(walked) == len(path) and not self._matcher.is_terminated():
                    self._matcher.fill_next_token_bitmask(bitmask, first_row + i)
        finally:
            if walked:
                self._matcher.rollback(len(walked))


def fill_bitmask(rows: Sequence[tuple[Optional[SequenceGrammar], Sequence[Sequence[int]]]],
                 vocab_size: int) -> Optional[tuple[torch.Tensor, list[int]]]:
    """The step's token mask: ``rows`` holds, per sequence in row order, its grammar (None when
    unconstrained) and its rows' draft paths. Returns the ``(num_rows, ceil(V / 32))`` int32
    bitmask and the constrained row indices, or None when no row is constrained."""
    if all(grammar is None for grammar, _ in rows):
        return None
    xgr = import_xgrammar()
    bitmask = xgr.allocate_token_bitmask(sum(len(paths) for _, paths in rows), vocab_size)
    indices: list[int] = []
    row = 0
    for grammar, paths in rows:
        if grammar is not None:
            grammar.fill(bitmask, row, paths)
            indices.extend(range(row, row + len(paths)))
        row += len(paths)
    return bitmask, indices


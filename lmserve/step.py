"""A step as plain data: what the scheduler hands the model runner.

The runner reads only this, never the scheduler's ``Sequence`` objects: it is what a
tensor-parallel rank will receive, and it already says everything speculative decoding needs
(several tokens per sequence, logits for several of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of a step."""

    start: int  # position of the first token to run; positions before it have KV in the cache
    token_ids: list[int]  # the tokens to run: a prompt chunk, or the newest token (then drafts)
    page_table: list[int]  # KV pages of positions [0, start + len(token_ids)), in order
    num_logits: int  # logit rows wanted, for the last num_logits tokens (0: none)
    # A draft tree (speculative decoding): each token's parent as its index in token_ids (-1:
    # the cached context), parents first; a token's position is then start + its depth. None: a
    # chain (token i at start + i).
    tree_parents: Optional[list[int]] = None
    # Recurrent layers: the slot holding the sequence's state after its first ``start`` tokens
    # (read unless start is 0, written after), and slots for the states after each of its
    # tokens but the last (a chain of drafts that may be rolled back). -1: no recurrent state.
    state_slot: int = -1
    history_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(f"num_logits must be in 0..{len(self.token_ids)}, got {self.num_logits}")
        if self.tree_parents is not None and (
                len(self.tree_parents) != len(self.token_ids)
                or any(not -1 <= p < i for i, p in enumerate(self.tree_parents))):
            raise ValueError(f"tree_parents must give each of the {len(self.token_ids)} tokens an "
                             f"earlier token or -1, got {self.tree_parents}")

    def tree_masks(self) -> Optional[list[int]]:
        """Per token, the bits of the step's tokens it attends (its ancestors and itself); None
        for a chain (see ``AttentionInput``)."""
        if self.tree_parents is None:
            return None
        masks: list[int] = []
        for i, p in enumerate(self.tree_parents):
            masks.append((masks[p] if p >= 0 else 0) | 1 << i)
        return masks

    def positions(self) -> list[int]:
        """Each token's position: ``start`` plus its depth below the cached context."""
        masks = self.tree_masks()
        if masks is None:
            return list(range(self.start, self.context_len))
        return [self.start + m.bit_count() - 1 for m in masks]

    @property
    def context_len(self) -> int:
        """Tokens with KV once the step has run: the attention context of its last token."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepInput:
    """Every sequence of one step, in the order their logit rows come back."""

    seqs: list[SeqStep]
    # Recurrent state copies (src slot, dst slot) to make, in order, before the step runs: a
    # rollback to a history slot, a prefix-cache snapshot taken or restored.
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.seqs)

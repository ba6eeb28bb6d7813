"""A step as plain data: what the scheduler hands the model runner.

The runner reads only this, never the scheduler's ``Sequence`` objects: it is what a
tensor-parallel rank will receive, and it already says everything speculative decoding needs
(several tokens per sequence, logits for several of them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of a step."""

    start: int  # position of the first token to run; positions before it have KV in the cache
    token_ids: list[int]  # the tokens to run: a prompt chunk, or the newest token (then drafts)
    page_table: list[int]  # KV pages of positions [0, start + len(token_ids)), in order
    num_logits: int  # logit rows wanted, for the last num_logits tokens (0: none)

    def __post_init__(self) -> None:
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(f"num_logits must be in 0..{len(self.token_ids)}, got {self.num_logits}")

    @property
    def context_len(self) -> int:
        """Tokens with KV once the step has run: the attention context of its last token."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepInput:
    """Every sequence of one step, in the order their logit rows come back."""

    seqs: list[SeqStep]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.seqs)

"""Multi-step decoding: a lone greedy sequence's next tokens, several a step, in one C++ call.

One stream decoding at the default level spends about 4 ms a token in kernels and 0.6 ms more in
Python: scheduling, the step's tensors, sampling, the output. When one sequence decodes alone
(nothing else running or waiting), greedily and with nothing that changes its logits (no
penalties, bias, grammar or logprobs; ``min_tokens`` reached), the engine runs its next tokens
as a ``GreedyChain`` over the target's own runner: the scheduler reserves their slots as it does
for drafts, and the step's tokens come back as a run of accepted drafts and the token after them
(``Scheduler.update`` keeps their KV). With speculation, the steps where the drafter drafts
nothing for it are runs too (``Speculator.plain_run``). The same kernels on the same inputs:
the same tokens as one step a token. The run stops after a stop or end-of-sequence token; stop
strings and ``max_tokens`` cut it in the output processor, as they cut accepted drafts.

How many tokens: as many as the last lone step's speed fits in ``RUN_SECONDS``, at most
``MAX_RUN``, within ``max_tokens`` and the longest sequence. A request that arrives meanwhile
waits at most that long for its first step, and a stream's tokens come in runs of about that
length (vLLM's multi-step scheduling made the same trade); at the full-precision level a token
takes longer than the budget, so it decodes a token a step.
"""

from __future__ import annotations

from typing import Optional

from lmserve.config import MAX_RUN, RUN_SECONDS
from lmserve.greedy_chain import GreedyChain
from lmserve.request import Sequence
from lmserve.runner import ModelRunner
from lmserve.scheduler import Batch
from lmserve.speculative.coupled import plain_greedy
from lmserve.speculative.tree import DraftTree


class MultiStepDecode:
    """The scheduler's ``lookahead`` for a lone sequence, and the run that fills its step."""

    @staticmethod
    def build(runner: ModelRunner, max_sequence_length: int,
              eos_token_ids: frozenset[int]) -> Optional[MultiStepDecode]:
        """Multi-step decoding over ``runner``, or None where its passes cannot run as one C++
        call (``GreedyChain.build``)."""
        chain = GreedyChain.build(runner)
        return None if chain is None else MultiStepDecode(chain, max_sequence_length, eos_token_ids)

    def __init__(self, chain: GreedyChain, max_sequence_length: int, eos_token_ids: frozenset[int]) -> None:
        self.chain = chain
        self.max_sequence_length = max_sequence_length
        self.eos_token_ids = eos_token_ids
        self.seconds_per_token: Optional[float] = None  # the last lone plain step's or run's
        self._granted: Optional[Sequence] = None  # the sequence given a run's slots this step

    def lookahead(self, seqs: list[Sequence], alone: bool) -> list[int]:
        """Slots past each decoding sequence's token: a run's for a lone one that can take one
        (``alone``: nothing else is running or waiting), else none."""
        self._granted = None
        if not (alone and len(seqs) == 1 and self.seconds_per_token and self._plain(seqs[0])):
            return [0] * len(seqs)
        seq = seqs[0]
        run = min(MAX_RUN, int(RUN_SECONDS / self.seconds_per_token),
                  self.max_sequence_length - len(seq.token_ids))
        max_tokens = seq.request.params.max_tokens
        if max_tokens is not None:
            run = min(run, max_tokens - seq.num_output_tokens)
        if run > 1:
            self._granted = seq
        return [max(0, run - 1)]

    def run(self, batch: Batch) -> bool:
        """Run the batch's lone chunk as a chain if it was given slots for one: its tokens in
        ``batch.tokens``, all but the last as its accepted drafts. False: a plain step."""
        c = batch.chunks[0] if len(batch.chunks) == 1 else None
        granted, self._granted = self._granted, None
        if c is None or c.seq is not granted or not c.num_lookahead or len(c.draft):
            return False  # (slots granted for drafts, or none granted)
        seq = c.seq
        tokens = self.chain.run(seq.token_ids[-1], seq.num_computed, list(seq.pages), 1 + c.num_lookahead,
                                seq.request.params.stop_ids(self.eos_token_ids), float("-inf"))
        c.draft = DraftTree.chain(tokens[:-1])
        c.accepted = list(range(len(c.draft)))
        batch.tokens = tokens
        return True

    def record(self, batch: Batch, seconds: float) -> None:
        """Time a step: a run's, or a lone decoding chunk's without drafts, sizes the next runs."""
        if batch.tokens is not None:
            self.seconds_per_token = seconds / len(batch.tokens)
        elif len(batch.chunks) == 1 and batch.chunks[0].decode and not batch.chunks[0].draft:
            self.seconds_per_token = seconds

    @staticmethod
    def _plain(seq: Sequence) -> bool:
        """Whether the sequence's next tokens are the raw logits' argmax, each."""
        params = seq.request.params
        return (plain_greedy(params) and params.logprobs is None and seq.grammar is None
                and seq.num_output_tokens >= params.min_tokens)

"""Request and sequence state: what the scheduler, runner and output processor share."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from lmserve.outputs import FinishReason, TokenLogprob
    from lmserve.sampling_params import SamplingParams
    from lmserve.structured.matcher import SequenceGrammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV pages and takes part in steps
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One user request: a prompt and its sampling parameters, generating ``params.n`` choices."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list["Sequence"] = field(default_factory=list)  # the choices scheduled
    first_scheduled_time: Optional[float] = None  # time.monotonic() of its first step
    # ``prompt_logprobs``: the first choice scores the prompt; the others wait here until it has
    # (then they share its KV through the prefix cache). Entry i: prompt token i + 1's logprob.
    deferred: list["Sequence"] = field(default_factory=list)
    prompt_logprobs: list["TokenLogprob"] = field(default_factory=list)
    prompt_logprobs_reported: bool = False

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason (its pages may be freed later in the step)."""
        return not self.deferred and all(s.finish_reason is not None for s in self.seqs)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token after the first has its logprob (or none was asked)."""
        return (self.params.prompt_logprobs is None
                or len(self.prompt_logprobs) == len(self.prompt_token_ids) - 1)


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its tokens, how many of them have KV in the cache, and its pages.

    ``token_ids`` is the prompt followed by the generated tokens. Tokens
    ``[num_computed, len(token_ids))`` still need a forward pass: the prompt (or its rest) while
    prefilling, the newest sampled token while decoding, everything after a preemption.
    """

    request: Request
    index: int
    token_ids: list[int]
    seed: Optional[int]  # of the sampling noise (see EngineCore); None for greedy
    num_computed: int = 0
    num_draft_computed: int = 0  # tokens with KV in a draft model's cache (small_draft)
    pages: list[int] = field(default_factory=list)
    # Entries of ``pages`` after the sink pages that a sliding window gave back (RELEASED).
    num_released_pages: int = 0
    # Recurrent-state models: the slot of its state and those for rollback (cache.state_manager).
    state_slot: int = -1
    history_slots: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[str, int, None] = None
    # Per-choice output state (detokenizer, stop checker), owned by the output processor.
    output_state: Any = None
    # Per-choice state of the speculative drafter, owned by it.
    draft_state: Any = None
    # Structured output: its place in the request's grammar, or None.
    grammar: Optional["SequenceGrammar"] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending(self) -> int:
        """Tokens that still need a forward pass."""
        return len(self.token_ids) - self.num_computed

    @property
    def scores_prompt(self) -> bool:
        """It computes its request's prompt logprobs and has not finished (the first choice)."""
        return self.index == 0 and not self.request.prompt_scored

    @property
    def is_decoding(self) -> bool:
        """The sequence's one prefill/decode state: decoding once every token but its newest
        sampled one has KV; prefilling before (its prompt, or everything again after a
        preemption), even when a single token is left."""
        return self.num_output_tokens > 0 and self.num_pending == 1

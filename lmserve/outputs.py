"""Plain data the engine hands back to its callers, one batch of deltas per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class TokenLogprob:
    """Log-probability of one generated token, and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class SequenceDelta:
    """What one choice (of the request's ``n``) produced since its previous delta."""

    index: int  # which choice, 0 .. n-1
    text: str  # new text; a possible start of a stop string is held back until resolved
    token_ids: list[int]  # new token ids (the stop token itself included when one ended it)
    logprobs: Optional[list[TokenLogprob]] = None  # one per token id when logprobs were asked
    finish_reason: Optional[FinishReason] = None
    # The stop string or stop token id that ended the choice; None for eos or length.
    stop_reason: Union[str, int, None] = None


@dataclass
class RequestOutput:
    """One step's news for a request: a delta per choice that moved, and whether all are done."""

    request_id: str
    prompt_token_ids: list[int]
    deltas: list[SequenceDelta]
    finished: bool
    # Set when the engine failed this request (and only it): the caller raises it.
    error: Optional[BaseException] = None
    # time.monotonic() when the request first took part in a step (None before): the end of
    # its time in the queue.
    first_scheduled_time: Optional[float] = None
    # ``prompt_logprobs``, once, with the first output after the prompt is scored: per prompt
    # token its logprob given the tokens before it (None for the first, which has none).
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None


@dataclass
class EngineStats:
    """A snapshot of the engine's state and its counters since start."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    num_preemptions: int
    prefill_tokens: int  # prompt tokens computed (again after a preemption)
    decode_tokens: int  # tokens decoding steps produced (accepted drafts included)
    steps: int
    prefix_cache_pages: int  # pages the prefix cache holds (some may be shared with requests)
    prefix_cache_queried_tokens: int  # prompt tokens of admitted requests looked up in the cache
    prefix_cache_hit_tokens: int  # of which were found there and not computed again
    # Speculative decoding (0 / [] when off): verify steps of a sequence that had drafts,
    # drafted tokens, accepted ones, and accepted ones per draft position (first draft first).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

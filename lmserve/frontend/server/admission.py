"""Admission of generation requests: bounds on what is in flight, and the drain before shutdown."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from lmserve.frontend.server.errors import APIError


@dataclass(frozen=True)
class Weight:
    """What one request asks of the engine: its sequences (prompts x n) and prompt tokens."""

    sequences: int
    tokens: int


class AdmissionGate:
    """Weighs generation requests from admission until their answer is complete.

    A request is admitted while the sequences and the prompt tokens in flight, its own included,
    stay within ``max_sequences`` and ``max_tokens``; past them it gets 429 (with
    ``Retry-After``) instead of waiting without bound behind others in the engine's queue. A
    request alone is admitted whatever its tokens (its size per request is bounded elsewhere).
    Once draining has started, every new request gets 503 while those admitted run to their end.

    Used from the event loop thread only, so plain counters suffice.
    """

    def __init__(self, max_sequences: int, max_tokens: int) -> None:
        self.max_sequences = max_sequences
        self.max_tokens = max_tokens
        self.in_flight = 0  # requests
        self.sequences = 0
        self.tokens = 0
        self._drain_deadline: Optional[float] = None  # time.monotonic() when draining gives up

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def check_open(self) -> None:
        """Raise 503 while draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests",
                           code="server_shutting_down")

    def enter(self, weight: Weight) -> None:
        """Admit one request, or raise 503 (draining) or 429 (full). Pair with ``leave``."""
        self.check_open()
        full = None
        if self.sequences + weight.sequences > self.max_sequences:
            full = (f"{self.max_sequences} sequences in flight ({self.sequences} now, this request "
                    f"{weight.sequences})")
        elif self.in_flight and self.tokens + weight.tokens > self.max_tokens:
            full = (f"{self.max_tokens} prompt tokens in flight ({self.tokens} now, this request "
                    f"{weight.tokens})")
        if full is not None:
            raise APIError(429, f"the server is at its limit of {full}; retry later",
                           code="too_many_requests", headers={"Retry-After": "1"})
        self.in_flight += 1
        self.sequences += weight.sequences
        self.tokens += weight.tokens

    def leave(self, weight: Weight) -> None:
        """One admitted request has been answered (or given up)."""
        self.in_flight -= 1
        self.sequences -= weight.sequences
        self.tokens -= weight.tokens

    def start_draining(self, grace: float) -> None:
        """Stop admitting; ``drained`` turns true when the last request is done or after
        ``grace`` seconds, whichever comes first."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + grace

    def stop_waiting(self) -> None:
        """End the drain now (a second signal)."""
        self._drain_deadline = time.monotonic()

    def drained(self) -> bool:
        return self._drain_deadline is not None and (
            self.in_flight == 0 or time.monotonic() >= self._drain_deadline)

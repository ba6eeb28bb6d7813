"""Admission of generation requests: a bound on those in flight, and the drain before shutdown."""

from __future__ import annotations

import time
from typing import Optional

from lmserve.server.errors import APIError


class AdmissionGate:
    """Counts generation requests from admission until their answer is complete.

    A request that would exceed ``max_in_flight`` gets 429 (with ``Retry-After``) instead of
    waiting without bound in the engine's queue; once draining has started, every new request
    gets 503 while those already admitted run to their end.

    Used from the event loop thread only, so plain counters suffice.
    """

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._drain_deadline: Optional[float] = None  # time.monotonic() when draining gives up

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def check_open(self) -> None:
        """Raise 503 while draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests",
                           code="server_shutting_down")

    def enter(self) -> None:
        """Admit one request, or raise 503 (draining) or 429 (full). Pair with ``leave``."""
        self.check_open()
        if self.in_flight >= self.max_in_flight:
            raise APIError(429, f"the server is at its limit of {self.max_in_flight} requests in "
                                f"flight; retry later", code="too_many_requests",
                           headers={"Retry-After": "1"})
        self.in_flight += 1

    def leave(self) -> None:
        """One admitted request has been answered (or given up)."""
        self.in_flight -= 1

    def start_draining(self, grace: float) -> None:
        """Stop admitting; ``drained`` turns true when the last request is done or after
        ``grace`` seconds, whichever comes first."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + grace

    def drained(self) -> bool:
        return self._drain_deadline is not None and (
            self.in_flight == 0 or time.monotonic() >= self._drain_deadline)

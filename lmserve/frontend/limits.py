"""What one request may ask of the engine: bounds a server sets so that one client cannot take
the engine thread, its memory or its queue from everyone else.

The OpenAI facades check them (``RequestLimits.check``) right after parsing a request, before
any text is tokenized, so a request over a limit costs almost nothing. The Python API runs
without them (``RequestLimits()``: its caller owns the engine); ``lmserve serve`` sets them from
its flags (docs/server.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmserve.errors import InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; None means no bound."""

    # Characters of a request's stop strings together. Matching is linear in the text, but the
    # matcher (built in about 2 ms per 1,000 characters) and the held-back text grow with them.
    max_stop_chars: Optional[int] = None
    # Sequences one request may start: prompts x n. It also bounds the prompt list's length.
    max_sequences: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_stop_chars", "max_sequences"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

    def check(self, stop: list[str], num_prompts: int, n: int) -> None:
        """Raise ``InvalidRequestError`` naming the field when a request goes past a limit."""
        if self.max_stop_chars is not None and sum(map(len, stop)) > self.max_stop_chars:
            raise InvalidRequestError(
                f"the stop strings have {sum(map(len, stop))} characters; this server allows at "
                f"most {self.max_stop_chars} in all", "stop")
        if self.max_sequences is not None and num_prompts * n > self.max_sequences:
            param = "prompt" if num_prompts > self.max_sequences else "n"
            raise InvalidRequestError(
                f"the request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x n={n}); "
                f"this server allows at most {self.max_sequences} per request", param)

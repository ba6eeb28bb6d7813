"""The error a request that cannot be served as asked raises, wherever it is found to be so
(the OpenAI frontend's validation, the engine's checks, grammar compiling)."""

from __future__ import annotations

from typing import Optional

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request too long for the model


class InvalidRequestError(ValueError):
    """A request that cannot be served as asked; ``param`` names the field at fault (or None),
    ``code`` is OpenAI's short code for the case where it has one (``context_length_exceeded``)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

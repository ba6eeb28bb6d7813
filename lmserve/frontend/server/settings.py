"""What the HTTP server is told besides the engine config: where to listen and what to allow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ServerSettings:
    """Options of ``lmserve serve`` that are not ``EngineConfig`` fields."""

    host: str = "127.0.0.1"  # loopback only unless asked: the server has no TLS
    port: int = 8000
    # When set, /v1/*, /tokenize and /detokenize need "Authorization: Bearer <api_key>".
    api_key: Optional[str] = None
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    # Sequences (prompts x n) of the generation requests in flight (admitted and not finished)
    # before new requests get 429.
    max_waiting: int = 256
    # Prompt tokens (times n) in flight before new requests get 429; None: four times what the
    # KV cache holds.
    max_waiting_tokens: Optional[int] = None
    # Sequences (prompts x n) one request may start; None: OpenAI's limit on n (128). Those
    # past the engine's batch wait in its queue.
    max_seqs_per_request: Optional[int] = None
    max_stop_chars: int = 1024  # characters of a request's stop strings together
    served_model_name: Optional[str] = None  # the name clients use; None: the model's file name
    shutdown_grace: float = 30.0  # seconds running requests get to finish after SIGTERM
    # Seconds a connection may take to send a request's headers (from its opening, or from the
    # end of its previous answer); then it is closed.
    header_timeout: float = 10.0
    body_timeout: float = 30.0  # seconds to receive a request's whole body, else 408
    keep_alive_timeout: float = 5.0  # seconds an idle connection stays open after an answer

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        for name in ("max_waiting_tokens", "max_seqs_per_request"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_stop_chars < 1:
            raise ValueError(f"max_stop_chars must be at least 1, got {self.max_stop_chars}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must not be negative, got {self.shutdown_grace}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it out to serve without a key)")

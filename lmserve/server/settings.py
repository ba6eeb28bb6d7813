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
    # Generation requests in flight (admitted and not finished) before new ones get 429.
    max_waiting: int = 256
    served_model_name: Optional[str] = None  # the name clients use; None: the model's file name
    shutdown_grace: float = 30.0  # seconds running requests get to finish after SIGTERM

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must not be negative, got {self.shutdown_grace}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it out to serve without a key)")

"""The engine as the server's OpenAI facades see it: under its served name, and measured."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Optional

from lmserve.engine.async_engine import AsyncEngine
from lmserve.frontend.server.metrics import ServerMetrics
from lmserve.outputs import RequestOutput
from lmserve.sampling_params import SamplingParams


class ServedModel:
    """An ``AsyncBackend`` (see ``lmserve.frontend.openai.facades``) over an ``AsyncEngine``.

    Responses carry ``name`` as their model, requests naming another model are refused, and
    every engine request's output stream passes through ``metrics``.
    """

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, name: Optional[str] = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = name or engine.model_name
        self.max_model_len = engine.max_model_len
        self.generation_defaults = engine.generation_defaults

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for a request the engine would refuse."""
        self.engine.validate(prompt_token_ids, params)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The engine's stream for this request, measured; closing it aborts the request."""
        return self.metrics.measure(self.engine.generate(prompt_token_ids, params, request_id), params.n)

"""What every route of one app shares: the engine, its facades, the gate, metrics and settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from lmserve.engine.async_engine import AsyncEngine
from lmserve.frontend.limits import RequestLimits
from lmserve.frontend.openai.facades import AsyncChat, AsyncCompletions
from lmserve.frontend.openai.protocol import MAX_N
from lmserve.frontend.server.admission import AdmissionGate
from lmserve.frontend.server.backend import ServedModel
from lmserve.frontend.server.body import read_json_object
from lmserve.frontend.server.errors import APIError
from lmserve.frontend.server.metrics import ServerMetrics
from lmserve.frontend.server.offload import Offload
from lmserve.frontend.server.settings import ServerSettings


@dataclass
class ServerState:
    """The app's shared objects (``app.state.lmserve``); the engine is reached through ``model``."""

    settings: ServerSettings
    metrics: ServerMetrics
    model: ServedModel
    chat: AsyncChat
    completions: AsyncCompletions
    gate: AdmissionGate
    offload: Offload = field(default_factory=Offload)  # tokenizing, off the event loop
    started: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(cls, engine: AsyncEngine, settings: ServerSettings) -> ServerState:
        """The state of an app serving ``engine``."""
        metrics = ServerMetrics(engine.stats)
        model = ServedModel(engine, metrics, settings.served_model_name)
        plan = engine.plan
        # By default a request may ask for as many sequences as OpenAI allows choices (those past
        # the batch wait in the engine's queue); never more than the whole in-flight bound.
        per_request = min(settings.max_seqs_per_request or MAX_N, settings.max_waiting)
        limits = RequestLimits(max_stop_chars=settings.max_stop_chars, max_sequences=per_request)
        # Tokens in flight: four times the KV cache (a model without KV, all recurrent: four
        # times what its sequences may hold together).
        max_tokens = settings.max_waiting_tokens or 4 * (
            plan.num_pages * plan.page_size or plan.max_total_sequence_length)
        return cls(settings, metrics, model, AsyncChat(model, limits), AsyncCompletions(model, limits),
                   AdmissionGate(settings.max_waiting, max_tokens))

    async def read_body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object body, within the size and time limits."""
        return await read_json_object(request, self.settings.max_body_bytes, self.settings.body_timeout)

    def check_model(self, name: Any) -> None:
        """Raise 404 for a request naming a model that is not served here (None or "": the one
        served, as vLLM reads them).

        A ``model`` that is not even a string is left to the request's own validation (400).
        """
        if isinstance(name, str) and name and name != self.model.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves "
                                f"`{self.model.model_name}`)", "model", "model_not_found")


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request``."""
    return request.app.state.lmserve

"""``GET /v1/models`` and ``GET /v1/models/{model}``: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from lmserve.frontend.server.routes import api_access
from lmserve.frontend.server.state import ServerState, server_state

router = APIRouter(dependencies=[Depends(api_access)])


def _card(state: ServerState) -> dict[str, Any]:
    # OpenAI's model object, plus vLLM's max_model_len so that clients can size prompts.
    return {"id": state.model.model_name, "object": "model", "created": state.started,
            "owned_by": "lmserve", "max_model_len": state.model.max_model_len}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The served model, as OpenAI's model list."""
    return {"object": "list", "data": [_card(server_state(request))]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    """The served model's card; 404 for any other name."""
    state = server_state(request)
    state.check_model(model)
    return _card(state)

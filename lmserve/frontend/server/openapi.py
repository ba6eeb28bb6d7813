"""The server's OpenAPI document (``GET /openapi.json``), from the same pydantic models that
validate its requests and shape its answers.

The routes read their bodies by hand (to answer every error in OpenAI's shape), so FastAPI sees
no body models; the request and response schemas are filled in here. Clients can generate code
from it, and the fuzz tests (schemathesis) generate requests from it.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from lmserve import __version__
from lmserve.frontend.openai.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
)
from lmserve.frontend.server.routes import ROUTE_MODULES
from lmserve.frontend.server.routes.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeTextRequest


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: Any = None
    code: Any = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every error answer has."""

    error: _ErrorDetail


_REQUESTS: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, TokenizeTextRequest,
                                    TokenizeChatRequest, DetokenizeRequest]
_RESPONSES: list[type[BaseModel]] = [ChatCompletion, ChatCompletionChunk, Completion, ErrorResponse]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server's routes, with their request and response bodies."""
    app = FastAPI()
    for module in ROUTE_MODULES:
        app.include_router(module.router)
    doc = get_openapi(title="lmserve", version=__version__, routes=app.routes,
                      description="An OpenAI-compatible LLM server (see docs/server.md).")
    _, defs = models_json_schema([(m, "validation") for m in _REQUESTS] + [(m, "serialization") for m in _RESPONSES],
                                 ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {})["schemas"] = defs["$defs"]
    bodies: dict[str, tuple[dict[str, Any], dict[str, Any], Optional[dict[str, Any]]]] = {
        "/v1/chat/completions": (_ref(ChatCompletionRequest), _ref(ChatCompletion), _ref(ChatCompletionChunk)),
        "/v1/completions": (_ref(CompletionRequest), _ref(Completion), _ref(Completion)),
        "/tokenize": ({"oneOf": [_ref(TokenizeTextRequest), _ref(TokenizeChatRequest)]}, {"type": "object"}, None),
        "/detokenize": (_ref(DetokenizeRequest), {"type": "object"}, None),
    }
    for path, (request, answer, chunk) in bodies.items():
        op = doc["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": _json(request)}
        ok = _json(answer)
        if chunk is not None:  # "stream": true answers server-sent events, one chunk per event
            ok["text/event-stream"] = {"schema": {"type": "string"},
                                       "x-event-schema": chunk}
        op["responses"] = {"200": {"description": "the answer", "content": ok},
                           "default": {"description": "an error, in OpenAI's shape",
                                       "content": _json(_ref(ErrorResponse))}}
    for path, item in doc["paths"].items():
        for op in item.values():
            op["responses"].pop("422", None)  # FastAPI's validation answer, which never leaves
    doc["components"]["schemas"].pop("HTTPValidationError", None)
    doc["components"]["schemas"].pop("ValidationError", None)
    return doc

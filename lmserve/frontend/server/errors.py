"""Every error the server answers, in OpenAI's shape and with the right HTTP status.

OpenAI's body is ``{"error": {"message", "type", "param", "code"}}``. Whatever fails (a field,
malformed JSON, an unknown route or model, a full queue, an engine failure), the client gets
that body: FastAPI's own 422 validation answer and its ``{"detail": ...}`` bodies never leave.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from lmserve.engine.loop import EngineShutDown
from lmserve.errors import InvalidRequestError

# The "type" per status: OpenAI's where OpenAI has the case, a plain description otherwise.
_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
    499: "client_closed_request", 500: "server_error", 503: "service_unavailable",
}


class APIError(Exception):
    """An error answer: HTTP status, message, the request field at fault and a short code."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[Mapping[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def from_exception(cls, exc: BaseException) -> APIError:
        """An ``APIError`` for anything a request can fail with: the caller's fault (400), the
        server stopping under it (503) or, for any other exception, the server's failure (500)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, InvalidRequestError):
            return cls(400, exc.message, exc.param, exc.code)
        if isinstance(exc, EngineShutDown):  # the server is stopping: expected, not a failure
            return cls(503, "the server shut down before the request finished", code="server_shutting_down")
        return cls(500, f"the server failed while handling the request: {type(exc).__name__}: {exc}")

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; nobody reads what is sent back."""


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    return APIError.from_exception(exc).response()


async def _client_disconnected(request: Request, exc: Exception) -> JSONResponse:
    return APIError(499, "the client closed the connection").response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=exc.headers).response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    # Only path parameters are declared to FastAPI (bodies are parsed by hand), so this is rare.
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ())]
    return APIError(400, f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid request')}",
                    loc[-1] if loc else None).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug in the server: Starlette re-raises it after this answer, so uvicorn logs it.
    return APIError.from_exception(exc).response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of ``app`` an OpenAI error body."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(InvalidRequestError, _api_error)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)
    app.add_exception_handler(ClientDisconnect, _client_disconnected)  # Starlette's, mid-body
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)

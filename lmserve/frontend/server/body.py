"""Reading a request's JSON body: bounded in size, and every way it can be malformed is a 400."""

from __future__ import annotations

import asyncio
import json
from typing import Any, NoReturn

from fastapi import Request

from lmserve.frontend.server.errors import APIError


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                    code="request_too_large")


def _refuse_constant(name: str) -> NoReturn:
    # Python's json module accepts NaN and Infinity, which JSON itself does not have.
    raise ValueError(f"{name} is not valid JSON")


async def _read(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_object(request: Request, limit: int, timeout: float) -> dict[str, Any]:
    """The body as a JSON object, at most ``limit`` bytes, received within ``timeout`` seconds.

    The declared Content-Length is checked before anything is read, and the bytes actually
    received as they arrive (a chunked body declares no length, and a client may lie). A body
    still arriving after ``timeout`` gets 408: a slow client must not hold a connection forever.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    try:
        raw = await asyncio.wait_for(_read(request, limit), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, absurd nesting
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body

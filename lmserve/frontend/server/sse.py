"""Server-sent events in OpenAI's streaming format: ``data: <json>`` per chunk, then ``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lmserve.frontend.server.errors import APIError

DONE = b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk_event(chunk: BaseModel) -> bytes:
    """One stream chunk as an event.

    OpenAI leaves unset fields out of a chat chunk's ``delta`` (``{"content": "x"}``, and
    ``{}`` on the last chunk) while writing ``null`` elsewhere (``"finish_reason": null``).
    """
    payload = chunk.model_dump(mode="json")
    for choice in payload.get("choices", ()):
        if isinstance(choice.get("delta"), dict):
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return _event(payload)


async def _events(first: BaseModel, rest: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    yield chunk_event(first)
    try:
        async for chunk in rest:
            yield chunk_event(chunk)
    except Exception as exc:  # the stream has started: the status is sent, so the error is an event
        yield _event(APIError.from_exception(exc).body())
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A stream of chunks as server-sent events, whose resources are released however it ends.

    ``rest`` is closed (which aborts its engine requests) and ``on_close`` is called when the
    response ends: completed, failed, or cut by the client. That happens here rather than in a
    generator's ``finally``, which would never run for a generator that was never started.
    """

    def __init__(self, first: BaseModel, rest: AsyncGenerator[BaseModel, None],
                 on_close: Callable[[], None]) -> None:
        """``first`` is the stream's first chunk, already taken from ``rest``."""
        super().__init__(_events(first, rest), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._rest = rest
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._rest.aclose()
            finally:
                self._on_close()

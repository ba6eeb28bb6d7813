"""``POST /v1/chat/completions`` and ``POST /v1/completions``: the engine's OpenAI facades over HTTP.

A request is validated and tokenized (in a worker thread: a long text or chat template must not
hold up the event loop, which serves every other client), admitted by its weight (or refused
with 429/503), then run. Non-streaming, the answer
is one JSON body. Streaming, the first chunk is awaited before the response starts, so a request
that fails before producing anything still gets a real HTTP status; after that, a failure is
one error event followed by ``data: [DONE]``.

A client that disconnects has its engine requests aborted: while waiting for a whole answer (or
the first chunk) the connection is polled, and once a stream is under way Starlette notices.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable
from typing import TypeVar, Union

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from lmserve.frontend.openai.facades import AsyncChatCompletions, AsyncCompletions, PreparedRequest
from lmserve.frontend.server.admission import Weight
from lmserve.frontend.server.errors import APIError, ClientDisconnected
from lmserve.frontend.server.routes import api_access
from lmserve.frontend.server.sse import EventStreamResponse
from lmserve.frontend.server.state import ServerState, server_state

logger = logging.getLogger("lmserve")
router = APIRouter(dependencies=[Depends(api_access)])

DISCONNECT_POLL_S = 0.1  # how soon a client that left stops costing engine steps
_T = TypeVar("_T")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completion, streaming or not."""
    state = server_state(request)
    return await _generate(request, state, state.chat.completions)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """OpenAI's (legacy) text completion: prompt as text, texts, token ids or token id lists."""
    state = server_state(request)
    return await _generate(request, state, state.completions)


async def until_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await ``work``, but cancel it and raise ``ClientDisconnected`` if the client leaves first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()  # cancelling the facade's await aborts its engine requests
            await asyncio.gather(task, return_exceptions=True)


async def _generate(request: Request, state: ServerState,
                    facade: Union[AsyncChatCompletions, AsyncCompletions]) -> Response:
    body = await state.read_body(request)
    state.check_model(body.get("model"))
    try:
        prepare = functools.partial(facade.prepare, **body)
        prepared = await until_disconnected(request, state.offload.run(prepare))
        return await _run_admitted(request, state, facade, prepared)
    except ClientDisconnected:
        raise
    except Exception as exc:
        raise _api_error(request, exc) from None


async def _run_admitted(request: Request, state: ServerState,
                        facade: Union[AsyncChatCompletions, AsyncCompletions],
                        prepared: PreparedRequest) -> Response:
    weight = Weight(prepared.num_sequences, prepared.num_prompt_tokens)
    state.gate.enter(weight)
    handed_over = False  # to a stream response, which leaves the gate when it ends
    try:
        result = await until_disconnected(request, facade.run(prepared))
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json")
        try:
            first = await until_disconnected(request, anext(result))
        except BaseException:
            await result.aclose()
            raise
        handed_over = True
        return EventStreamResponse(first, result, on_close=functools.partial(state.gate.leave, weight))
    finally:
        if not handed_over:
            state.gate.leave(weight)


def _api_error(request: Request, exc: Exception) -> APIError:
    """The answer for an exception; the server's own failures are logged with their traceback."""
    error = APIError.from_exception(exc)
    if error.status == 500:
        logger.error("%s failed", request.url.path, exc_info=exc)
    return error

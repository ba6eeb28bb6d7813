"""The asyncio Python API: ``AsyncEngine``, the same surface as ``Engine`` with async iterators."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

from lmserve.engine.engine import EngineBase, new_request_id
from lmserve.engine.openai_api import AsyncChat, AsyncCompletions
from lmserve.outputs import RequestOutput
from lmserve.sampling_params import SamplingParams


class AsyncEngine(EngineBase):
    """An engine for asyncio programs: awaiting a result never blocks the event loop."""

    def __init__(self, model: Optional[str] = None, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iteration early (or cancelling) aborts it."""
        request_id = request_id or new_request_id()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def sink(out) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass

        self._loop.submit(request_id, prompt_token_ids, params, sink)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._loop.abort(request_id)

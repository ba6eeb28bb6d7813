"""The asyncio Python API: ``AsyncEngine``, the same surface as ``Engine`` with async iterators."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, AsyncGenerator, Optional

from lmserve.engine.engine import EngineBase, new_request_id
from lmserve.frontend.openai.facades import AsyncChat, AsyncCompletions
from lmserve.outputs import RequestOutput
from lmserve.sampling_params import SamplingParams


class _Mailbox:
    """Outputs from the engine thread to the request queues of one event loop, in batches.

    Waking a loop from another thread writes to its self-pipe (a system call on the engine
    thread, which the kernels' other thread then waits for). The first output posted schedules
    one wake-up; outputs posted before it runs ride along, so one step's outputs for many
    streams usually cost a single wake-up. Each queue still gets its outputs in order.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak, so that the engine's map of mailboxes (weak keys: the loops) lets a finished loop go.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """Put ``item`` on ``queue`` from the engine thread."""
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:
                return  # a wake-up is already scheduled
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed or gone: nobody is listening, keep nothing
            with self._lock:
                self._items.clear()

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


class AsyncEngine(EngineBase):
    """An engine for asyncio programs: awaiting a result never blocks the event loop."""

    def __init__(self, model: Optional[str] = None, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.chat = AsyncChat(self)
        self.completions = AsyncCompletions(self)
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> _Mailbox
        self._mailboxes_lock = threading.Lock()

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        with self._mailboxes_lock:
            box = self._mailboxes.get(loop)
            if box is None:
                box = self._mailboxes[loop] = _Mailbox(loop)
            return box

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: Optional[str] = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs; leaving the iteration early (or cancelling) aborts it."""
        request_id = request_id or new_request_id()
        outputs: asyncio.Queue = asyncio.Queue()
        mailbox = self._mailbox(asyncio.get_running_loop())
        self._loop.submit(request_id, prompt_token_ids, params, lambda out: mailbox.post(outputs, out))
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

"""Blocking work of requests (tokenizing, the chat template) in worker threads, a few at a time."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class Offload:
    """Runs blocking calls in the event loop's worker threads, at most ``slots`` at once.

    The event loop stays free for every other client while a long prompt is tokenized, and
    requests beyond the slots wait their turn without holding a thread. A request whose client
    leaves stops waiting at once, but keeps its slot until its thread is done: a thread cannot
    be stopped, so many clients sending long prompts and hanging up never pile up more than
    ``slots`` threads of work.
    """

    def __init__(self, slots: int = 0) -> None:
        """``slots``: threads at once; 0 means one per core."""
        self.slots = slots or os.cpu_count() or 1
        self._free = asyncio.Semaphore(self.slots)

    async def run(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` in a worker thread, once a slot is free."""
        await self._free.acquire()
        try:
            future = asyncio.get_running_loop().run_in_executor(None, fn)
        except BaseException:
            self._free.release()
            raise
        future.add_done_callback(lambda _: self._free.release())
        # Shielded: cancelling the caller must not mark the work done while its thread runs.
        return await asyncio.shield(future)

"""The page pool of the paged KV cache: which pages are free, and how many owners each has.

The pool only hands out page ids; the KV tensors themselves live in :class:`~lmserve.cache.kv.KVCache`
and are indexed by ``page * page_size + offset`` (a "slot"). Reference counts let a page be shared
(prefix cache, forked sequences) and return it to the free list only when its last owner lets go.

The free list is a stack: the page freed last is handed out first. A page's memory is taken from
the system when it is first written (see ``OnDemandBuffer``), so reusing the same few pages keeps
the process's resident memory at the KV in use; handing out the oldest free page instead walked
every allocation onto untouched memory until the whole pool was resident. Pages that stay free
long enough are reported by ``idle_pages`` so that their memory can go back to the system.
"""

from __future__ import annotations

import time

from lmserve.cache.free_list import FreeList


class PagePool:
    """A fixed set of ``num_pages`` pages with reference counts.

    Free pages are handed out most recently freed first (lowest id first at the start).
    """

    def __init__(self, num_pages: int) -> None:
        self._free = FreeList(num_pages, "pages")  # 0 pages: a model without attention layers
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._freed_at: dict[int, float] = {}  # free pages written since their memory was given back

    @property
    def num_free(self) -> int:
        return self._free.num_free

    @property
    def num_used(self) -> int:
        return self._free.num_used

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with one owner; all or nothing (``OutOfIds``)."""
        pages = self._free.alloc(n)
        for p in pages:
            self._refs[p] = 1
            self._freed_at.pop(p, None)
        return pages

    def share(self, pages: list[int]) -> None:
        """Add one owner to each of ``pages`` (they must be in use)."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is free and cannot be shared")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one owner from each of ``pages``; a page with no owner left becomes free."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} released more often than taken")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.release([p])
                self._freed_at[p] = time.monotonic()

    @property
    def num_unreleased(self) -> int:
        """Free pages that were used and whose memory has not been reported idle yet."""
        return len(self._freed_at)

    def idle_pages(self, min_idle_s: float) -> list[int]:
        """Free pages that have been free for ``min_idle_s`` seconds and were used before; each is
        reported once (until it is used and freed again), so that the caller can give its
        memory back to the system."""
        cutoff = time.monotonic() - min_idle_s
        idle = [p for p, t in self._freed_at.items() if t <= cutoff]
        for p in idle:
            del self._freed_at[p]
        return idle


"""The page pool of the paged KV cache: which pages are free, and how many owners each has.

The pool only hands out page ids; the KV tensors themselves live in :class:`~lmserve.cache.kv.KVCache`
and are indexed by ``page * page_size + offset`` (a "slot"). Reference counts let a page be shared
(prefix cache, forked sequences) and return it to the free list only when its last owner lets go.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(Exception):
    """Raised when an allocation asks for more pages than are free."""


class PagePool:
    """A fixed set of ``num_pages`` pages with reference counts.

    Free pages are handed out lowest id first and returned to the back of the queue, so the
    ids a test sees are deterministic.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with one owner; all or nothing."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
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
                self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)

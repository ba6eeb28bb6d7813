"""Which of a fixed set of ids (KV pages, recurrent-state slots) are free.

A stack: the id freed last is handed out first, and the lowest first at the start, so the ids a
test sees are deterministic and reuse keeps touching the same few ids' memory (see ``PagePool``).
"""

from __future__ import annotations


class OutOfIds(Exception):
    """An allocation asked for more ids than are free."""


class FreeList:
    """The free ids among ``0 .. size - 1``; ``unit`` names them in errors ("pages")."""

    def __init__(self, size: int, unit: str) -> None:
        if size < 0:
            raise ValueError(f"the number of {unit} must be >= 0, got {size}")
        self.size = size
        self._unit = unit
        self._free = list(range(size - 1, -1, -1))  # the end is handed out next

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free ids; all or nothing."""
        if n > len(self._free):
            raise OutOfIds(f"asked for {n} {self._unit}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        """Give ``ids`` back (the caller knows they were taken)."""
        self._free.extend(ids)

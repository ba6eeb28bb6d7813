"""The prefix cache of recurrent-state models: state snapshots keyed by the tokens they follow.

A recurrent layer's state after n tokens stands for the whole prefix, but only that prefix: it
cannot be cut back to a shorter one as KV pages can. So the cache keeps whole states at chosen
points (the end of a finished sequence, prompt-chunk boundaries) and a new sequence starts from
the longest one whose tokens begin its prompt (as vLLM and SGLang cache Mamba states). Snapshots
are state slots; the least recently used goes when the cache is full or a sequence needs a slot.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class StateSnapshots:
    """At most ``capacity`` snapshots: token prefix -> the slot holding the state after it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: OrderedDict[tuple[int, ...], int] = OrderedDict()  # least recent first
        self._lengths: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._slots)

    def match(self, tokens: list[int], multiple: int = 1) -> tuple[int, int]:
        """(length, slot) of the longest snapshot whose tokens begin ``tokens`` and whose length
        is a multiple of ``multiple``; (0, -1) when there is none."""
        for n in sorted(self._lengths, reverse=True):
            key = tuple(tokens[:n])
            if n <= len(tokens) and n % multiple == 0 and key in self._slots:
                self._slots.move_to_end(key)
                return n, self._slots[key]
        return 0, -1

    def holds(self, tokens: list[int]) -> bool:
        return tuple(tokens) in self._slots

    def insert(self, tokens: list[int], slot: int) -> list[int]:
        """Keep ``slot`` as the state after ``tokens``; returns the slots that left the cache
        (the oldest, past capacity) for the caller to free. A prefix already held is not
        inserted: ``[slot]`` comes back."""
        key = tuple(tokens)
        if key in self._slots or self.capacity == 0:
            return [slot]
        self._slots[key] = slot
        self._lengths[len(key)] += 1
        freed = []
        while len(self._slots) > self.capacity:
            freed.append(self.evict())
        return freed

    def evict(self) -> int:
        """Drop the least recently used snapshot (there must be one); its slot."""
        key, slot = self._slots.popitem(last=False)
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
        return slot

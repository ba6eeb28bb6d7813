"""Sliding-window attention with attention sinks: which keys a query sees, and at which positions.

A query at position ``p`` sees the last ``size`` keys including itself (positions
``p - size + 1 .. p``, as Hugging Face transformers' sliding-window mask has it) and, with
``sinks = s``, the first ``s`` keys of its sequence as well, whatever its position (StreamingLLM).

Positions: keys are stored rotated at their own positions, as without a window, and the window's
keys are scored as always (rotary scores depend only on the distance between query and key,
which inside the window never exceeds ``size - 1``). Only the sinks move: they are scored as if
they sat just before the oldest key of the window, which is StreamingLLM's rule (positions
within the cache: sinks ``0 .. s-1``, the window's keys after them) for every score. Rotating
the sink key ``j`` forward by the same amount for all sinks equals rotating the query back by
it, so a query scores the sinks with its own vector rotated at ``sink_position(p)`` instead of
``p``. No stored key is ever rotated again, and the largest distance a score sees is
``size + s - 1`` however long the sequence runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.util import cdiv


@dataclass(frozen=True)
class AttentionWindow:
    """The window of the windowed layers of a model: ``size`` keys, the first ``sinks`` always."""

    size: int
    sinks: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.sinks < self.size:
            raise ValueError(f"a window needs size >= 1 and 0 <= sinks < size, got size={self.size}, "
                             f"sinks={self.sinks}")

    def lowest_key(self, position: int) -> int:
        """The oldest key of the window of a query at ``position``."""
        return max(0, position - self.size + 1)

    def sees(self, key: int, position: int) -> bool:
        """Whether a query at ``position`` attends the key at ``key`` (``key <= position``)."""
        return key < self.sinks or key >= self.lowest_key(position)

    @property
    def last_sink_position(self) -> int:
        """The farthest position a query scores the sinks from (see the module doc)."""
        return self.sinks + self.size - 1

    def sink_position(self, position: int) -> int:
        """The position a query at ``position`` scores the sinks from."""
        return min(position, self.last_sink_position) if self.sinks else position

    def first_needed(self, position: int) -> int:
        """The oldest key past the sinks that a query at ``position`` or later can still see."""
        return max(self.sinks, self.lowest_key(position))

    def max_pages(self, page_size: int, step_tokens: int) -> int:
        """The most pages a sequence holds in a step of ``step_tokens`` tokens when every layer
        is windowed: its sink pages, and those of the ``size - 1`` keys before the step's
        first token and the step's own (one more where they straddle a page)."""
        return cdiv(self.sinks, page_size) + cdiv(self.size - 1 + step_tokens, page_size) + 1

    def describe(self) -> str:
        return f"{self.size} tokens" + (f" + {self.sinks} sinks" if self.sinks else "")

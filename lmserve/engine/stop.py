"""Stop-string detection on one choice's streamed text, without ever emitting part of a stop string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional


class StopChecker:
    """Cuts one choice's text stream at its first stop string.

    Text arrives in arbitrary pieces (one detokenized token, several, or a single character), so a
    stop string may straddle any number of pieces. ``feed`` therefore holds back the longest tail
    of the not-yet-emitted text that could still grow into a stop string, and emits it only once
    it can no longer do so.

    The match that wins is the one completed first in the stream (smallest end position; on a tie
    the longest, i.e. the one starting earliest). That rule does not depend on how the text was
    split into pieces, so streaming and non-streaming runs cut at the same place.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        """``stop``: the stop strings (empty strings are ignored: they would match everywhere)."""
        self._stops = sorted({s for s in stop if s}, key=len, reverse=True)
        self._include = include_stop_str_in_output
        # Every proper prefix of every stop string: the held-back tail must be one of these.
        self._prefixes = {s[:i] for s in self._stops for i in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._pending = ""  # text received but not emitted: always a member of _prefixes, or ""
        self._matched: Optional[str] = None

    def feed(self, new_text: str) -> tuple[str, Optional[str]]:
        """Add the choice's next piece of text.

        Returns ``(text safe to emit now, matched stop string or None)``. Once a stop string is
        returned the choice is over: the text returned with it ends right before the stop string
        (or right after it with ``include_stop_str_in_output``), and further calls are an error.
        """
        if self._matched is not None:
            raise RuntimeError(f"text fed after stop string {self._matched!r} already ended the sequence")
        if not self._stops:
            return new_text, None
        # The pending text holds no complete stop string (it would have matched already), so any
        # match ends inside new_text, and the search never needs to go further back than it.
        text = self._pending + new_text
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop string)
        for s in self._stops:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, s = best
            self._pending = ""
            self._matched = s
            return text[: end if self._include else start], s
        hold = self._longest_held_tail(text)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Release the held-back text when the choice ends for another reason (eos, length, abort)."""
        text, self._pending = self._pending, ""
        return text

    def _longest_held_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_hold), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0

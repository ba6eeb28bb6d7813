"""Stop-string detection on one choice's streamed text, without ever emitting part of a stop string."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from typing import Optional


class StopAutomaton:
    """An Aho-Corasick automaton over a set of stop strings, shared by the choices of a request.

    Built in time and memory linear in the stop strings' total length. Its states are the
    prefixes of the stop strings (a trie); walking the text one character at a time keeps the
    state at the longest suffix of the text read so far that is such a prefix, in amortized
    constant time per character.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]  # length of each state's prefix
        for s in stops:
            state = 0
            for ch in s:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                state = nxt
        terminal = {self._find(s) for s in stops}
        # fail: the longest proper suffix of a state that is a state too. match: the length of
        # the longest stop string that is a suffix of the state (the state itself if it is one).
        self.fail = [0] * len(self.goto)
        self.match: list[Optional[int]] = [None] * len(self.goto)
        queue = deque([0])
        while queue:  # breadth first: a state's fail is shallower, so it is done before it
            state = queue.popleft()
            for ch, child in self.goto[state].items():
                if state:
                    f = self.fail[state]
                    while f and ch not in self.goto[f]:
                        f = self.fail[f]
                    self.fail[child] = self.goto[f].get(ch, 0)
                self.match[child] = (self.depth[child] if child in terminal
                                     else self.match[self.fail[child]])
                queue.append(child)

    def _find(self, s: str) -> int:
        state = 0
        for ch in s:
            state = self.goto[state][ch]
        return state

    def step(self, state: int, ch: str) -> int:
        """The state after reading ``ch`` in ``state``."""
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


@functools.lru_cache(maxsize=32)
def _automaton(stops: tuple[str, ...]) -> StopAutomaton:
    # The n choices of a request (and repeated requests) share one automaton.
    return StopAutomaton(stops)


def _key(stop: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted({s for s in stop if s}))


def prepare_stops(stop: Sequence[str]) -> None:
    """Build (and cache) the automaton of these stop strings now, off the engine thread, so that
    the request's first tokens find it ready."""
    if _key(stop):
        _automaton(_key(stop))


class StopChecker:
    """Cuts one choice's text stream at its first stop string.

    Text arrives in arbitrary pieces (one detokenized token, several, or a single character), so a
    stop string may straddle any number of pieces. ``feed`` therefore holds back the longest tail
    of the not-yet-emitted text that could still grow into a stop string, and emits it only once
    it can no longer do so.

    The match that wins is the one completed first in the stream (smallest end position; on a tie
    the longest, i.e. the one starting earliest). That rule does not depend on how the text was
    split into pieces, so streaming and non-streaming runs cut at the same place.

    Time is linear in the text fed and memory in the stop strings (an Aho-Corasick automaton):
    a long stop string costs its length once, never its length squared.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        """``stop``: the stop strings (empty strings are ignored: they would match everywhere)."""
        stops = _key(stop)
        self._automaton = _automaton(stops) if stops else None
        self._include = include_stop_str_in_output
        self._state = 0  # the automaton's state after the text fed so far
        self._pending = ""  # text received but not emitted: the state's prefix, or ""
        self._matched: Optional[str] = None

    def feed(self, new_text: str) -> tuple[str, Optional[str]]:
        """Add the choice's next piece of text.

        Returns ``(text safe to emit now, matched stop string or None)``. Once a stop string is
        returned the choice is over: the text returned with it ends right before the stop string
        (or right after it with ``include_stop_str_in_output``), and further calls are an error.
        """
        if self._matched is not None:
            raise RuntimeError(f"text fed after stop string {self._matched!r} already ended the sequence")
        a = self._automaton
        if a is None:
            return new_text, None
        state = self._state
        for i, ch in enumerate(new_text):
            state = a.step(state, ch)
            length = a.match[state]
            if length is not None:  # the first stop string to end, and the longest ending here
                text = self._pending + new_text[: i + 1]
                self._matched = text[len(text) - length:]
                self._pending = ""
                return (text if self._include else text[: len(text) - length]), self._matched
        self._state = state
        text = self._pending + new_text
        hold = a.depth[state]
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Release the held-back text when the choice ends for another reason (eos, length, abort)."""
        text, self._pending, self._state = self._pending, "", 0
        return text

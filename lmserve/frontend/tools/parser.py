"""Reading tool calls out of a choice's streamed text, one delta at a time.

``ToolCallStream.feed`` takes each text delta and returns the content to show and the tool-call
pieces to send, OpenAI's way: a call's first piece carries its index, id, type and name with empty
arguments, the next its arguments. A non-streamed answer is these same pieces folded
(``frontend/openai/builders.py``), so both agree by construction. Text that might be the start of a call tag
is held back until it is known not to be one (as stop strings are); a block that does not parse
(an answer cut by ``max_tokens``) is shown as content, never dropped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional

from lmserve.frontend.tools.formats import ToolFormat


@dataclass(frozen=True)
class ToolCallPiece:
    """Part of a tool call: the first piece of call ``index`` has its id and name."""

    index: int
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a start of ``tag`` (it may be completed)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Splits one choice's text into content and tool calls in ``fmt``'s format."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.num_calls = 0
        self._held = ""  # text not yet known to be content or a call
        self._block: Optional[str] = None  # the open call block's text so far
        self._started = False  # some non-whitespace text came (whole-answer formats decide then)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallPiece]]:
        """The content and call pieces ``text`` releases; ``final`` on the choice's last delta."""
        if self.fmt.whole_answer:
            return self._feed_whole(text, final)
        buf, content = self._held + text, ""
        pieces: list[ToolCallPiece] = []
        self._held = ""
        begin, end = self.fmt.begin, self.fmt.end
        while True:
            if self._block is None:
                at = buf.find(begin)
                if at < 0:
                    keep = 0 if final else _held_prefix(buf, begin)
                    released, self._held = buf[:len(buf) - keep], buf[len(buf) - keep:]
                    if self.num_calls and not released.strip():
                        # Whitespace after a call separates calls: shown only if text follows.
                        self._held = "" if final else released + self._held
                        released = ""
                    content += released
                    break
                before = buf[:at]
                if not (self.num_calls and not before.strip()):
                    content += before
                buf, self._block = buf[at + len(begin):], ""
                continue
            at = buf.find(end)
            if at < 0:
                keep = 0 if final else _held_prefix(buf, end)
                self._block += buf[:len(buf) - keep]
                self._held = buf[len(buf) - keep:]
                if final:
                    content += self._close(pieces, closed=False)
                break
            if self.fmt.parse_block(self._block + buf[:at]) is None:
                # Not a whole call yet: the end tag is inside a JSON string; read on.
                self._block += buf[:at + len(end)]
                buf = buf[at + len(end):]
                continue
            self._block += buf[:at]
            buf = buf[at + len(end):]
            content += self._close(pieces, closed=True)
        return content, pieces

    def _feed_whole(self, text: str, final: bool) -> tuple[str, list[ToolCallPiece]]:
        if self._block is not None:
            self._block += text
        elif self._started:
            return text, []
        else:
            self._held += text
            stripped = self._held.lstrip()
            if not stripped:
                return ("", []) if not final else (self._take_held(), [])
            self._started = True
            if not stripped.startswith("{"):
                return self._take_held(), []
            self._block, self._held = stripped, ""
        if not final:
            return "", []
        pieces: list[ToolCallPiece] = []
        return self._close(pieces, closed=True), pieces

    def _take_held(self) -> str:
        held, self._held = self._held, ""
        return held

    def _close(self, pieces: list[ToolCallPiece], closed: bool) -> str:
        """End the open block: its calls go to ``pieces``; returns it as content if it is none."""
        block, self._block = self._block or "", None
        calls = self.fmt.parse_block(block)
        if calls is None:
            return self.fmt.begin + block + (self.fmt.end if closed else "")
        for call in calls:
            index = self.num_calls
            self.num_calls += 1
            pieces.append(ToolCallPiece(index, "", new_call_id(), call.name))
            pieces.append(ToolCallPiece(index, call.arguments))
        return ""

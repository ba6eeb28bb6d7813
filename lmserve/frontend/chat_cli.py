"""The interactive terminal chat behind ``lmserve chat``.

``ChatSession`` keeps the conversation and streams each answer to the terminal; ``run_chat`` is
the read-eval loop around it, with the ``/`` commands. Both talk to the engine only through
``engine.chat.completions.create``, the OpenAI-shaped API.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Optional, TextIO

USER_PROMPT = "You: "
ASSISTANT_PREFIX = "Assistant: "

COMMANDS = {
    "/reset": "forget the conversation (the system prompt stays)",
    "/stats": "prefill and decode speed of the last answer",
    "/help": "show this help",
    "/exit": "quit (Ctrl-D and Ctrl-C quit too)",
}


@dataclass(frozen=True)
class AnswerStats:
    """Token counts and timings of one answer."""

    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float  # seconds from sending the request to the first token
    decode_time: float  # seconds from the first token to the last

    @property
    def prefill_tokens_per_s(self) -> Optional[float]:
        """Prompt tokens / time to first token; None if no time could be measured."""
        ttft = self.time_to_first_token
        return self.prompt_tokens / ttft if ttft > 0 else None

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        """Tokens after the first / the time they took; None with fewer than two tokens."""
        if self.completion_tokens < 2 or self.decode_time <= 0:
            return None
        return (self.completion_tokens - 1) / self.decode_time

    def describe(self) -> str:
        """Two lines for ``/stats``."""
        prefill, decode = self.prefill_tokens_per_s, self.decode_tokens_per_s
        return (
            f"prefill: {_rate(prefill)} ({self.prompt_tokens} prompt tokens, "
            f"{self.time_to_first_token:.3f} s to the first token)\n"
            f"decode: {_rate(decode)} ({self.completion_tokens} completion tokens, "
            f"{self.decode_time:.3f} s after the first)"
        )


def _rate(tokens_per_s: Optional[float]) -> str:
    return "n/a" if tokens_per_s is None else f"{tokens_per_s:.1f} tokens/s"


class ChatSession:
    """One conversation with an engine: the message history and the stats of the last answer."""

    def __init__(self, engine: Any, out: TextIO, system: Optional[str] = None,
                 options: Optional[dict[str, Any]] = None) -> None:
        """``engine`` has ``chat.completions.create``; answers are written to ``out`` as they
        stream; ``options`` are request fields (temperature, max_tokens, ...) for every turn."""
        self.engine = engine
        self.out = out
        self.system = system
        self.options = dict(options or {})
        self.messages: list[dict[str, str]] = []
        self.last_stats: Optional[AnswerStats] = None
        self.reset()

    def reset(self) -> None:
        """Forget every turn; keep the system prompt."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str) -> None:
        """Send ``text`` as the next user turn and stream the answer to ``out``.

        A turn the engine refuses (e.g. the conversation no longer fits the context) prints the
        reason and leaves the history as it was, so the user can /reset or try a shorter turn.
        """
        self.messages.append({"role": "user", "content": text})
        try:
            answer, stats = self._stream_answer()
        except ValueError as err:  # InvalidRequestError, or the engine refusing the prompt
            self.messages.pop()
            self.out.write(f"error: {err}\n")
            return
        self.messages.append({"role": "assistant", "content": answer})
        self.last_stats = stats

    def _stream_answer(self) -> tuple[str, AnswerStats]:
        start = time.perf_counter()
        first: Optional[float] = None
        last: Optional[float] = None
        parts: list[str] = []
        usage = None
        stream = self.engine.chat.completions.create(
            messages=self.messages, stream=True, stream_options={"include_usage": True},
            **self.options)
        # closing(): leaving early (Ctrl-C) aborts the request in the engine right away.
        with closing(stream):
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                # Every chunk with a choice stands for at least one new token (or the finish).
                last = time.perf_counter()
                if first is None:
                    first = last
                    self.out.write(ASSISTANT_PREFIX)
                content = chunk.choices[0].delta.content
                if content:
                    parts.append(content)
                    self.out.write(content)
                    self.out.flush()
        self.out.write("\n")
        if usage is None or first is None:
            raise RuntimeError("the engine's stream ended without an answer or its usage")
        assert last is not None  # set with first
        return "".join(parts), AnswerStats(usage.prompt_tokens, usage.completion_tokens,
                                           first - start, last - first)


def help_text() -> str:
    """What ``/help`` prints."""
    width = max(map(len, COMMANDS))
    return "\n".join(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items())


def make_reader(stdin: TextIO, out: TextIO) -> Callable[[str], str]:
    """A ``prompt -> line`` reader; raises EOFError at the end of input.

    On a terminal it is ``input`` with readline's line editing and history. Piped input gets a
    plain reader that still prints the prompt and echoes the line, because a terminal does not
    show piped text and the transcript would otherwise lack the user's side.
    """
    if stdin.isatty():
        try:
            import readline  # noqa: F401  (importing it is what gives input() line editing)
        except ImportError:  # not on every platform; input() still works without it
            pass
        return input

    def read(prompt: str) -> str:
        out.write(prompt)
        out.flush()
        line = stdin.readline()
        if not line:
            raise EOFError
        line = line.rstrip("\r\n")
        out.write(line + "\n")
        return line

    return read


def run_chat(engine: Any, system: Optional[str] = None, options: Optional[dict[str, Any]] = None,
             stdin: Optional[TextIO] = None, out: Optional[TextIO] = None) -> int:
    """Chat with ``engine`` until /exit, end of input or Ctrl-C; returns the exit status
    (0, or 130 after Ctrl-C as shells expect). The caller shuts the engine down."""
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    session = ChatSession(engine, out, system, options)
    read = make_reader(stdin, out)
    out.write(f"lmserve chat with {engine.model_name}; type /help for commands\n")
    try:
        while True:
            try:
                line = read(USER_PROMPT).strip()
            except EOFError:
                out.write("\n")  # end the prompt's line so the shell's prompt starts clean
                return 0
            if not line:
                continue
            if not line.startswith("/"):
                session.ask(line)
            elif line == "/exit":
                return 0
            elif line == "/reset":
                session.reset()
                out.write("conversation cleared\n")
            elif line == "/stats":
                stats = session.last_stats
                out.write((stats.describe() if stats else "no answer yet") + "\n")
            elif line == "/help":
                out.write(help_text() + "\n")
            else:
                out.write(f"unknown command {line.split()[0]!r}; the commands are:\n"
                          f"{help_text()}\n")
    except KeyboardInterrupt:
        out.write("\n")
        return 130
    finally:
        out.flush()

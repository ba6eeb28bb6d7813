"""OpenAI-shaped results from the engine's RequestOutput streams: pure, engine-independent builders.

``ChatStreamBuilder`` / ``CompletionStreamBuilder`` turn each ``RequestOutput`` into stream
chunks; ``ChatResponseBuilder`` / ``CompletionResponseBuilder`` fold those same chunks into one
response, so streaming and non-streaming results agree by construction. The Python API's facades
(``facades.py``) and the HTTP server both use them.
"""

from __future__ import annotations

import codecs
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lmserve.frontend.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatDeltaFunction,
    ChatDeltaToolCall,
    ChatFunctionCall,
    ChatMessage,
    ChatTokenLogprob,
    ChatToolCall,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    TopLogprob,
    Usage,
)
from lmserve.frontend.tools.formats import ToolFormat
from lmserve.frontend.tools.parser import ToolCallPiece, ToolCallStream
from lmserve.outputs import RequestOutput, SequenceDelta, TokenLogprob
from lmserve.tokenizer import TokenBytes

# OpenAI reports -9999.0 for tokens whose probability underflowed (JSON has no -Infinity).
_LOWEST_LOGPROB = -9999.0


class RequestAborted(RuntimeError):
    """The engine aborted the request before it finished (shutdown, or an abort from elsewhere)."""


# ---------------------------------------------------------------------------------------------
# Token text and bytes, as OpenAI's logprobs spell them


def token_text(raw: bytes) -> str:
    """A token as OpenAI's logprobs show it: its UTF-8 text, or ``bytes:\\xNN..`` when it is only
    part of a character (as OpenAI does for such tokens)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _logprob(value: float) -> float:
    return value if value > _LOWEST_LOGPROB else _LOWEST_LOGPROB  # also maps -inf and NaN


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_bytes: TokenBytes) -> ChatChoiceLogprobs:
    """OpenAI chat logprobs (``{"content": [{token, logprob, bytes, top_logprobs}]}``)."""

    def spell(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token_id)
        return dict(token=token_text(raw), logprob=_logprob(logprob), bytes=list(raw))

    return ChatChoiceLogprobs(content=[
        ChatTokenLogprob(**spell(lp.token_id, lp.logprob),
                         top_logprobs=[TopLogprob(**spell(t, v)) for t, v in lp.top])
        for lp in logprobs
    ])


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Optional[TokenLogprob]], token_bytes: TokenBytes,
    offsets: codecs.IncrementalDecoder, start: int, hidden: frozenset[int] = frozenset()
) -> tuple[CompletionLogprobs, int]:
    """OpenAI text completion logprobs for consecutive tokens of one choice (a None entry: a
    token without one, the first of an echoed prompt, is null as in OpenAI's API).

    ``start`` is the character offset of the first token in the choice's text; ``offsets``, the
    choice's UTF-8 decoder, carries a character split across tokens over to the next call. The
    tokens at the positions in ``hidden`` are not in the text (special tokens the tokenizer put
    around an echoed prompt's text, or that decoding its ids left out): they take no room in it.
    Returns the logprobs and the offset after the last token.
    """
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for i, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
        raw = token_bytes(token_id)
        out.tokens.append(token_text(raw))
        out.token_logprobs.append(None if lp is None else _logprob(lp.logprob))
        out.top_logprobs.append(None if lp is None else _top_with_chosen(lp, token_bytes))
        out.text_offset.append(start)
        if i not in hidden:
            start += len(offsets.decode(raw))
    return out, start


def _top_with_chosen(lp: TokenLogprob, token_bytes: TokenBytes) -> dict[str, float]:
    """A text completion's ``top_logprobs`` entry: the top alternatives and, as OpenAI always
    returns it, the chosen token (``logprobs + 1`` entries at most; ``logprobs: 0``, only it)."""
    top = {token_text(token_bytes(t)): _logprob(v) for t, v in lp.top}
    top.setdefault(token_text(token_bytes(lp.token_id)), _logprob(lp.logprob))
    return top


def join_completion_logprobs(pieces: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    """Consecutive pieces of one choice's logprobs as one."""
    return CompletionLogprobs(
        tokens=[t for lp in pieces for t in lp.tokens],
        token_logprobs=[v for lp in pieces for v in lp.token_logprobs],
        top_logprobs=[top for lp in pieces for top in lp.top_logprobs],
        text_offset=[o for lp in pieces for o in lp.text_offset],
    )


# ---------------------------------------------------------------------------------------------
# Stream builders


@dataclass
class _ChoiceState:
    """Per-choice bookkeeping of a stream."""

    started: bool = False
    finished: bool = False
    num_tokens: int = 0
    # Text completions only: where the next token starts in the choice's text.
    text_offset: int = 0
    utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class _StreamBuilder:
    """What chat and text completion streams share: identity, per-choice state and usage."""

    def __init__(self, request_id: str, model: str, created: int, prompt_tokens: int, token_bytes: TokenBytes,
                 include_usage: bool = False) -> None:
        """``request_id`` is the response id; ``token_bytes`` spells tokens for logprobs;
        ``include_usage`` adds a final chunk with the usage of the whole request."""
        self.request_id = request_id
        self.model = model
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.token_bytes = token_bytes
        self.include_usage = include_usage
        self._choices: dict[int, _ChoiceState] = defaultdict(_ChoiceState)

    def _advance(self, index: int, delta: SequenceDelta
                 ) -> tuple[_ChoiceState, bool, Optional[FinishReason]]:
        """Account for one delta of choice ``index``; returns its state, whether it is its first,
        and its finish reason (an aborted choice raises ``RequestAborted``)."""
        reason = delta.finish_reason
        if reason == "abort":
            raise RequestAborted(f"request {self.request_id} was aborted")
        state = self._choices[index]
        if state.finished:
            raise RuntimeError(f"choice {index} of {self.request_id} moved after it had finished")
        first, state.started = not state.started, True
        state.num_tokens += len(delta.token_ids)
        state.finished = reason is not None
        return state, first, reason

    @property
    def usage(self) -> Usage:
        """Token counts so far: the prompt(s) once, plus every choice's generated tokens."""
        completion = sum(s.num_tokens for s in self._choices.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)


class ChatStreamBuilder(_StreamBuilder):
    """``RequestOutput``s of one chat request -> ``ChatCompletionChunk``s.

    As OpenAI sends them: a choice's first chunk carries ``role: "assistant"`` alone, then one
    chunk per step that has news for it, and its last chunk the ``finish_reason`` alone; steps
    where a choice produced nothing visible (text held back as a possible stop string or call
    tag) yield no chunk for it.
    With ``tool_format``, tool calls in the text become ``delta.tool_calls`` pieces and a choice
    that called a tool and stopped finishes with ``"tool_calls"``.
    """

    def __init__(self, request_id: str, model: str, created: int, prompt_tokens: int, token_bytes: TokenBytes,
                 include_usage: bool = False, tool_format: Optional[ToolFormat] = None) -> None:
        """As ``_StreamBuilder``; ``tool_format``: read tool calls in that format from the text."""
        super().__init__(request_id, model, created, prompt_tokens, token_bytes, include_usage)
        self._tool_format = tool_format
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def add(self, output: RequestOutput) -> list[ChatCompletionChunk]:
        """The chunks for one step's output. Raises ``RequestAborted`` on an aborted choice."""
        chunks = []
        for delta in output.deltas:
            _, first, finish = self._advance(delta.index, delta)
            text = delta.text
            pieces: list[ToolCallPiece] = []
            if self._tool_format is not None:
                calls = self._tool_streams.setdefault(delta.index, ToolCallStream(self._tool_format))
                text, pieces = calls.feed(delta.text, final=finish is not None)
                if finish == "stop" and calls.num_calls:
                    finish = "tool_calls"
            if first:  # the role alone, with content "" as OpenAI's, but null before tool calls
                role = ChatDelta(role="assistant", content="" if self._tool_format is None else None)
                chunks.append(self._chunk([ChatChunkChoice(index=delta.index, delta=role)]))
            if text or pieces or delta.logprobs:
                chunks.append(self._chunk([ChatChunkChoice(
                    index=delta.index,
                    delta=ChatDelta(content=text or None, tool_calls=[_delta_tool_call(p) for p in pieces] or None),
                    logprobs=None if delta.logprobs is None else chat_logprobs(delta.logprobs, self.token_bytes),
                )]))
            if finish:  # in a chunk of its own with an empty delta, as OpenAI ends a choice
                chunks.append(self._chunk([ChatChunkChoice(index=delta.index, delta=ChatDelta(),
                                                           finish_reason=finish, stop_reason=delta.stop_reason)]))
        return chunks

    def finish(self) -> list[ChatCompletionChunk]:
        """What follows the last output: the usage chunk (no choices) when it was asked for."""
        return [self._chunk([], self.usage)] if self.include_usage else []


def _delta_tool_call(piece: ToolCallPiece) -> ChatDeltaToolCall:
    return ChatDeltaToolCall(index=piece.index, id=piece.id, type="function" if piece.id else None,
                             function=ChatDeltaFunction(name=piece.name, arguments=piece.arguments))


def _fold_tool_calls(parts: list[ChatChunkChoice]) -> Optional[list[ChatToolCall]]:
    """A choice's streamed tool-call pieces as whole calls, as a client reassembles them."""
    calls: dict[int, ChatToolCall] = {}
    for part in parts:
        for piece in part.delta.tool_calls or ():
            if piece.index not in calls:
                assert piece.id is not None and piece.function.name is not None  # a call's first piece
                calls[piece.index] = ChatToolCall(id=piece.id, function=ChatFunctionCall(
                    name=piece.function.name, arguments=""))
            calls[piece.index].function.arguments += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)] or None


@dataclass(frozen=True)
class CompletionPrompt:
    """One prompt of a text completion request, as the engine runs it."""

    request_id: str  # the engine request id its RequestOutputs carry
    num_tokens: int
    echo: Optional[str] = None  # text put before each of its choices (``echo: true``)
    echo_hidden: frozenset[int] = frozenset()  # positions of its tokens the echo does not show


class CompletionStreamBuilder(_StreamBuilder):
    """``RequestOutput``s of one text completion request -> ``Completion`` chunks.

    A request may hold several prompts, each run as its own engine request with ``n`` choices;
    choice ``i`` of prompt ``p`` is choice ``p * n + i`` of the response, as in OpenAI's API.
    With ``echo``, a choice's first chunk starts with its prompt, and with ``logprobs`` too, with
    the prompt's tokens and their logprobs (the engine's ``prompt_logprobs``).
    """

    def __init__(self, request_id: str, model: str, created: int, prompts: Sequence[CompletionPrompt], n: int,
                 token_bytes: TokenBytes, include_usage: bool = False) -> None:
        """As for chat, but with the request's prompts (each with the id of its engine request)."""
        super().__init__(request_id, model, created, sum(p.num_tokens for p in prompts), token_bytes,
                         include_usage)
        self._prompts = {p.request_id: (i, p) for i, p in enumerate(prompts)}
        self._n = n
        self._prompt_logprobs: dict[str, list[Optional[TokenLogprob]]] = {}  # by engine request

    def _chunk(self, choices: list[CompletionChoice], usage: Optional[Usage] = None) -> Completion:
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=choices,
                          usage=usage)

    def add(self, output: RequestOutput) -> list[Completion]:
        """The chunks for one step's output. Raises ``RequestAborted`` on an aborted choice."""
        prompt_index, prompt = self._prompts[output.request_id]
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[output.request_id] = output.prompt_logprobs
        chunks = []
        for delta in output.deltas:
            index = prompt_index * self._n + delta.index
            state, first, finish = self._advance(index, delta)
            text, pieces = delta.text, []
            if first and prompt.echo is not None:
                text = prompt.echo + text
                scored = self._prompt_logprobs.get(output.request_id)
                if scored is not None:
                    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
                    pieces.append(completion_logprobs(output.prompt_token_ids, scored, self.token_bytes,
                                                      utf8, 0, prompt.echo_hidden)[0])
                state.text_offset = len(prompt.echo)
            if delta.logprobs is not None:
                piece, state.text_offset = completion_logprobs(
                    delta.token_ids, delta.logprobs, self.token_bytes, state.utf8, state.text_offset)
                pieces.append(piece)
            if text or pieces:
                logprobs = join_completion_logprobs(pieces) if pieces else None
                chunks.append(self._chunk([CompletionChoice(index=index, text=text, logprobs=logprobs)]))
            if finish:  # in a chunk of its own, as OpenAI ends a choice
                chunks.append(self._chunk([CompletionChoice(index=index, text="", finish_reason=finish,
                                                            stop_reason=delta.stop_reason)]))
        return chunks

    def finish(self) -> list[Completion]:
        """What follows the last output: the usage chunk (no choices) when it was asked for."""
        return [self._chunk([], self.usage)] if self.include_usage else []


# ---------------------------------------------------------------------------------------------
# Response builders: the stream's chunks, folded


class _ResponseBuilder:
    """Collects a stream builder's chunk choices per choice index, for one full response."""

    def __init__(self, stream: Union[ChatStreamBuilder, CompletionStreamBuilder]) -> None:
        self._stream = stream
        self._parts: dict[int, list[Any]] = defaultdict(list)

    def add(self, output: RequestOutput) -> None:
        """Take one step's output. Raises ``RequestAborted`` on an aborted choice."""
        for chunk in self._stream.add(output):
            for choice in chunk.choices:
                self._parts[choice.index].append(choice)

    def _finished_parts(self) -> list[list[Any]]:
        """Each choice's chunk choices, in choice order; every choice must have finished."""
        groups = [self._parts[i] for i in sorted(self._parts)]
        for group in groups:
            if group[-1].finish_reason is None:
                raise RuntimeError(f"the outputs of {self._stream.request_id} ended before choice "
                                   f"{group[-1].index} finished")
        return groups


class ChatResponseBuilder(_ResponseBuilder):
    """``RequestOutput``s of one chat request -> one ``ChatCompletion`` with usage."""

    def __init__(self, request_id: str, model: str, created: int, prompt_tokens: int,
                 token_bytes: TokenBytes, tool_format: Optional[ToolFormat] = None) -> None:
        super().__init__(ChatStreamBuilder(request_id, model, created, prompt_tokens, token_bytes,
                                           tool_format=tool_format))
        self._stream: ChatStreamBuilder

    def build(self) -> ChatCompletion:
        """The response, once every choice has finished."""
        choices = []
        for parts in self._finished_parts():
            logprobs = [lp for p in parts if p.logprobs is not None for lp in p.logprobs.content]
            has_logprobs = any(p.logprobs is not None for p in parts)
            content = "".join(p.delta.content or "" for p in parts)
            tool_calls = _fold_tool_calls(parts)
            choices.append(ChatChoice(
                index=parts[0].index,
                message=ChatMessage(content=None if tool_calls and not content else content,
                                    tool_calls=tool_calls),
                logprobs=ChatChoiceLogprobs(content=logprobs) if has_logprobs else None,
                finish_reason=parts[-1].finish_reason,
                stop_reason=parts[-1].stop_reason,
            ))
        s = self._stream
        return ChatCompletion(id=s.request_id, created=s.created, model=s.model, choices=choices,
                              usage=s.usage)


class CompletionResponseBuilder(_ResponseBuilder):
    """``RequestOutput``s of one text completion request -> one ``Completion`` with usage."""

    def __init__(self, request_id: str, model: str, created: int, prompts: Sequence[CompletionPrompt], n: int,
                 token_bytes: TokenBytes) -> None:
        super().__init__(CompletionStreamBuilder(request_id, model, created, prompts, n, token_bytes))
        self._stream: CompletionStreamBuilder

    def build(self) -> Completion:
        """The response, once every choice has finished."""
        choices = []
        for parts in self._finished_parts():
            pieces = [p.logprobs for p in parts if p.logprobs is not None]
            logprobs = join_completion_logprobs(pieces) if pieces else None
            choices.append(CompletionChoice(
                index=parts[0].index,
                text="".join(p.text for p in parts),
                logprobs=logprobs,
                finish_reason=parts[-1].finish_reason,
                stop_reason=parts[-1].stop_reason,
            ))
        s = self._stream
        return Completion(id=s.request_id, created=s.created, model=s.model, choices=choices, usage=s.usage)

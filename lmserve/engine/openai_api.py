"""OpenAI-shaped results from the engine's RequestOutput streams, and the ``create`` facades on top.

Two layers:

* Builders, pure and engine-independent: ``ChatStreamBuilder`` / ``CompletionStreamBuilder``
  turn each ``RequestOutput`` into stream chunks; ``ChatResponseBuilder`` /
  ``CompletionResponseBuilder`` fold those same chunks into one response, so streaming and
  non-streaming results agree by construction. The HTTP server reuses them.
* Facades: ``Chat`` / ``Completions`` (sync) and ``AsyncChat`` / ``AsyncCompletions`` give an
  engine OpenAI's ``engine.chat.completions.create(...)`` and ``engine.completions.create(...)``.
  Everything but the iteration itself (validation, prompt rendering, builders) is shared.

What the facades need from their backend (the engine) is spelled out by ``Backend``,
``AsyncBackend`` and ``TokenizerLike`` below.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Sequence
from contextlib import aclosing, closing
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, TypeVar, Union

import jinja2

from lmserve.outputs import RequestOutput, SequenceDelta, TokenLogprob
from lmserve.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    InvalidRequestError,
    TopLogprob,
    Usage,
    GenerationRequest,
)
from lmserve.sampling_params import SamplingParams

TokenBytes = Callable[[int], bytes]  # token id -> the raw bytes it stands for
_T = TypeVar("_T")

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


def _gpt2_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def hf_token_bytes(hf: Any) -> TokenBytes:
    """``token id -> raw bytes`` for a Hugging Face tokenizer.

    ``decode([id])`` is not enough: it drops SentencePiece's leading space and turns a token that
    holds part of a UTF-8 character into U+FFFD. So read the vocabulary piece instead and undo
    the vocabulary's own byte encoding: GPT-2's printable-character table for byte-level BPE,
    ``▁`` for space and ``<0xNN>`` byte-fallback pieces for SentencePiece. Added tokens (chat
    markers and the like) are stored as plain text.
    """
    probe = hf.convert_ids_to_tokens(hf.encode(" a", add_special_tokens=False))
    byte_level = any("Ġ" in piece for piece in probe)  # GPT-2's spelling of a space
    char_to_byte = _gpt2_char_to_byte()
    added = set(hf.get_added_vocab().values())

    def token_bytes(token_id: int) -> bytes:
        piece = hf.convert_ids_to_tokens(token_id)
        if token_id in added:
            return piece.encode()
        if byte_level and all(c in char_to_byte for c in piece):
            return bytes(char_to_byte[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    return token_bytes


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
    logprobs: Sequence[TokenLogprob], token_bytes: TokenBytes, offsets: codecs.IncrementalDecoder, start: int
) -> tuple[CompletionLogprobs, int]:
    """OpenAI text completion logprobs for consecutive tokens of one choice.

    ``start`` is the character offset of the first token in the choice's text; ``offsets``, the
    choice's UTF-8 decoder, carries a character split across tokens over to the next call.
    Returns the logprobs and the offset after the last token.
    """
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for lp in logprobs:
        raw = token_bytes(lp.token_id)
        out.tokens.append(token_text(raw))
        out.token_logprobs.append(_logprob(lp.logprob))
        out.top_logprobs.append({token_text(token_bytes(t)): _logprob(v) for t, v in lp.top})
        out.text_offset.append(start)
        start += len(offsets.decode(raw))
    return out, start


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

    def _advance(self, index: int, delta: SequenceDelta) -> tuple[_ChoiceState, bool]:
        """Account for one delta of choice ``index``; returns its state and whether it is its first."""
        if delta.finish_reason == "abort":
            raise RequestAborted(f"request {self.request_id} was aborted")
        state = self._choices[index]
        if state.finished:
            raise RuntimeError(f"choice {index} of {self.request_id} moved after it had finished")
        first, state.started = not state.started, True
        state.num_tokens += len(delta.token_ids)
        state.finished = delta.finish_reason is not None
        return state, first

    @property
    def usage(self) -> Usage:
        """Token counts so far: the prompt(s) once, plus every choice's generated tokens."""
        completion = sum(s.num_tokens for s in self._choices.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)


class ChatStreamBuilder(_StreamBuilder):
    """``RequestOutput``s of one chat request -> ``ChatCompletionChunk``s.

    One chunk per choice that has news, as OpenAI sends them. A choice's first chunk carries
    ``role: "assistant"``, its last one the ``finish_reason``; steps where a choice produced
    nothing visible (text held back as a possible stop string) yield no chunk for it.
    """

    def _chunk(self, choices: list[ChatChunkChoice], usage: Optional[Usage] = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def add(self, output: RequestOutput) -> list[ChatCompletionChunk]:
        """The chunks for one step's output. Raises ``RequestAborted`` on an aborted choice."""
        chunks = []
        for delta in output.deltas:
            _, first = self._advance(delta.index, delta)
            if not (first or delta.text or delta.logprobs or delta.finish_reason):
                continue
            choice = ChatChunkChoice(
                index=delta.index,
                delta=ChatDelta(role="assistant" if first else None,
                                content=delta.text if delta.text or first else None),
                logprobs=None if delta.logprobs is None else chat_logprobs(delta.logprobs, self.token_bytes),
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
            )
            chunks.append(self._chunk([choice]))
        return chunks

    def finish(self) -> list[ChatCompletionChunk]:
        """What follows the last output: the usage chunk (no choices) when it was asked for."""
        return [self._chunk([], self.usage)] if self.include_usage else []


@dataclass(frozen=True)
class CompletionPrompt:
    """One prompt of a text completion request, as the engine runs it."""

    request_id: str  # the engine request id its RequestOutputs carry
    num_tokens: int
    echo: Optional[str] = None  # text put before each of its choices (``echo: true``)


class CompletionStreamBuilder(_StreamBuilder):
    """``RequestOutput``s of one text completion request -> ``Completion`` chunks.

    A request may hold several prompts, each run as its own engine request with ``n`` choices;
    choice ``i`` of prompt ``p`` is choice ``p * n + i`` of the response, as in OpenAI's API.
    """

    def __init__(self, request_id: str, model: str, created: int, prompts: Sequence[CompletionPrompt], n: int,
                 token_bytes: TokenBytes, include_usage: bool = False) -> None:
        """As for chat, but with the request's prompts (each with the id of its engine request)."""
        super().__init__(request_id, model, created, sum(p.num_tokens for p in prompts), token_bytes,
                         include_usage)
        self._prompts = {p.request_id: (i, p) for i, p in enumerate(prompts)}
        self._n = n

    def _chunk(self, choices: list[CompletionChoice], usage: Optional[Usage] = None) -> Completion:
        return Completion(id=self.request_id, created=self.created, model=self.model, choices=choices,
                          usage=usage)

    def add(self, output: RequestOutput) -> list[Completion]:
        """The chunks for one step's output. Raises ``RequestAborted`` on an aborted choice."""
        prompt_index, prompt = self._prompts[output.request_id]
        chunks = []
        for delta in output.deltas:
            index = prompt_index * self._n + delta.index
            state, first = self._advance(index, delta)
            # Logprobs never come with echo (refused: the prompt's own logprobs are not computed),
            # so text offsets start at 0.
            text = prompt.echo + delta.text if first and prompt.echo else delta.text
            logprobs = None
            if delta.logprobs is not None:
                logprobs, state.text_offset = completion_logprobs(
                    delta.logprobs, self.token_bytes, state.utf8, state.text_offset)
            if not (text or delta.logprobs or delta.finish_reason):
                continue
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
            chunks.append(self._chunk([choice]))
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
                 token_bytes: TokenBytes) -> None:
        super().__init__(ChatStreamBuilder(request_id, model, created, prompt_tokens, token_bytes))
        self._stream: ChatStreamBuilder

    def build(self) -> ChatCompletion:
        """The response, once every choice has finished."""
        choices = []
        for parts in self._finished_parts():
            logprobs = [lp for p in parts if p.logprobs is not None for lp in p.logprobs.content]
            has_logprobs = any(p.logprobs is not None for p in parts)
            choices.append(ChatChoice(
                index=parts[0].index,
                message=ChatMessage(content="".join(p.delta.content or "" for p in parts)),
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
            logprobs = None
            if pieces:
                logprobs = CompletionLogprobs(
                    tokens=[t for lp in pieces for t in lp.tokens],
                    token_logprobs=[v for lp in pieces for v in lp.token_logprobs],
                    top_logprobs=[top for lp in pieces for top in lp.top_logprobs],
                    text_offset=[o for lp in pieces for o in lp.text_offset],
                )
            choices.append(CompletionChoice(
                index=parts[0].index,
                text="".join(p.text for p in parts),
                logprobs=logprobs,
                finish_reason=parts[-1].finish_reason,
                stop_reason=parts[-1].stop_reason,
            ))
        s = self._stream
        return Completion(id=s.request_id, created=s.created, model=s.model, choices=choices, usage=s.usage)


# ---------------------------------------------------------------------------------------------
# What the facades need from the engine


class TokenizerLike(Protocol):
    """The tokenizer calls the facades make."""

    hf: Any  # the Hugging Face tokenizer: token bytes for logprobs (see ``hf_token_bytes``)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Text -> token ids; ``add_special_tokens`` adds the BOS the model expects at the start."""

    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text (for ``echo`` of a prompt given as token ids)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """Chat messages (OpenAI dicts) -> prompt token ids ending with the assistant's turn."""


class _BackendBase(Protocol):
    tokenizer: TokenizerLike
    model_name: str  # reported in responses; a request naming another model is refused
    max_model_len: int  # prompt plus generated tokens must fit in this


class Backend(_BackendBase, Protocol):
    """A sync engine: ``generate`` yields a request's outputs; closing the iterator aborts it."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> Iterator[RequestOutput]: ...


class AsyncBackend(_BackendBase, Protocol):
    """An async engine: as ``Backend``, with an async iterator (closing or cancelling aborts)."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...


# ---------------------------------------------------------------------------------------------
# Request preparation, shared by the sync and async facades


@dataclass
class _Job:
    """A validated request: the engine requests to run and the builder shaping their outputs."""

    runs: list[tuple[str, list[int], SamplingParams]]  # (engine request id, prompt ids, params)
    stream: bool
    builder: Union[ChatStreamBuilder, CompletionStreamBuilder, ChatResponseBuilder, CompletionResponseBuilder]


def _check_model(request: GenerationRequest, backend: _BackendBase) -> None:
    if request.model is not None and request.model != backend.model_name:
        raise InvalidRequestError(
            f"model {request.model!r} is not served here (this is {backend.model_name!r})", "model")


def _sampling_params(request: GenerationRequest, prompt_len: int, max_model_len: int,
                     prompt_param: str) -> SamplingParams:
    """The request's SamplingParams for one prompt, which together must fit the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(f"the prompt has {prompt_len} tokens, which leaves no room to generate "
                                  f"in the model's context of {max_model_len} tokens", prompt_param)
    params = request.to_sampling_params(default_max_tokens=room)
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidRequestError(
            f"{request.max_tokens_param} is {params.max_tokens}, but the prompt has {prompt_len} tokens "
            f"and the model's context is {max_model_len} tokens, which leaves room for {room}",
            request.max_tokens_param)
    return params


def template_message(message: Any) -> dict[str, Any]:
    """An OpenAI message (a protocol model) as chat templates expect it (a plain dict)."""
    m = message.model_dump(exclude_none=True)
    if m["role"] == "developer":
        m["role"] = "system"  # OpenAI's newer name; templates only know "system"
    if isinstance(m.get("content"), list):
        m["content"] = "\n".join(part["text"] for part in m["content"])  # text parts only, as vLLM joins them
    return m


def _prepare_chat(backend: _BackendBase, kwargs: dict[str, Any]) -> _Job:
    request = ChatCompletionRequest.parse(kwargs)
    _check_model(request, backend)
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    try:
        prompt = backend.tokenizer.apply_chat_template([template_message(m) for m in request.messages],
                                                       add_generation_prompt=True, tools=tools)
    except (ValueError, jinja2.TemplateError) as err:  # no template, or it refuses these messages
        raise InvalidRequestError(f"cannot render the chat template: {err}", "messages") from None
    params = _sampling_params(request, len(prompt), backend.max_model_len, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    common = dict(request_id=request_id, model=backend.model_name, created=int(time.time()),
                  prompt_tokens=len(prompt), token_bytes=_lazy_token_bytes(backend.tokenizer))
    builder: Union[ChatStreamBuilder, ChatResponseBuilder] = (
        ChatStreamBuilder(**common, include_usage=request.wants_usage_chunk) if request.stream
        else ChatResponseBuilder(**common))
    return _Job([(request_id, prompt, params)], bool(request.stream), builder)


def _prepare_completion(backend: _BackendBase, kwargs: dict[str, Any]) -> _Job:
    request = CompletionRequest.parse(kwargs)
    _check_model(request, backend)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    texts = request.prompts()
    runs, prompts = [], []
    for i, text in enumerate(texts):
        # A text prompt starts the sequence, so it gets the model's BOS (chat templates write theirs).
        ids = backend.tokenizer.encode(text, add_special_tokens=True) if isinstance(text, str) else list(text)
        params = _sampling_params(request, len(ids), backend.max_model_len, "prompt")
        run_id = request_id if len(texts) == 1 else f"{request_id}-{i}"
        echo = (text if isinstance(text, str) else backend.tokenizer.decode(ids)) if request.echo else None
        runs.append((run_id, ids, params))
        prompts.append(CompletionPrompt(run_id, len(ids), echo))
    common = dict(request_id=request_id, model=backend.model_name, created=int(time.time()), prompts=prompts,
                  n=runs[0][2].n, token_bytes=_lazy_token_bytes(backend.tokenizer))
    builder: Union[CompletionStreamBuilder, CompletionResponseBuilder] = (
        CompletionStreamBuilder(**common, include_usage=request.wants_usage_chunk) if request.stream
        else CompletionResponseBuilder(**common))
    return _Job(runs, bool(request.stream), builder)


@functools.lru_cache(maxsize=8)
def _cached_hf_token_bytes(hf: Any) -> TokenBytes:
    return hf_token_bytes(hf)


def _lazy_token_bytes(tokenizer: TokenizerLike) -> TokenBytes:
    """``hf_token_bytes`` of the tokenizer, set up once per tokenizer and only if logprobs need it."""
    return lambda token_id: _cached_hf_token_bytes(tokenizer.hf)(token_id)


# ---------------------------------------------------------------------------------------------
# The facades: only the iteration differs between sync and async


def _generate_one_by_one(backend: Backend, job: _Job) -> Generator[RequestOutput, None, None]:
    # A sync iterator can only wait on one engine request at a time, so the prompts of a
    # multi-prompt text completion run one after the other.
    for request_id, prompt, params in job.runs:
        yield from backend.generate(prompt, params, request_id)


# The closing() / aclosing() below make leaving early (an error, or the caller dropping a stream)
# close the engine streams right away, which is what aborts their requests.


def _stream(job: _Job, outputs: Iterator[RequestOutput]) -> Iterator[Any]:
    with closing(outputs):
        for output in outputs:
            yield from job.builder.add(output)
    yield from job.builder.finish()


def _run(backend: Backend, job: _Job) -> Any:
    outputs = _generate_one_by_one(backend, job)
    if job.stream:
        return _stream(job, outputs)
    with closing(outputs):
        for output in outputs:
            job.builder.add(output)
    return job.builder.build()


async def _merge(streams: list[AsyncIterator[_T]]) -> AsyncGenerator[_T, None]:
    """Items of all ``streams`` as they come.

    Each stream is drained by its own task; leaving early cancels the tasks, which is how an
    engine stream learns to abort its request (right away, not whenever the garbage collector
    gets to finalize an abandoned async generator).
    """
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[_T]) -> None:
        try:
            async for item in stream:
                await queue.put(("item", item))
        except Exception as err:  # raised again in the consumer
            await queue.put(("error", err))
        await queue.put(("done", None))

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                running -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream_async(job: _Job, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[Any]:
    async with aclosing(outputs):
        async for output in outputs:
            for chunk in job.builder.add(output):
                yield chunk
    for chunk in job.builder.finish():
        yield chunk


async def _run_async(backend: AsyncBackend, job: _Job) -> Any:
    outputs = _merge([backend.generate(prompt, params, run_id) for run_id, prompt, params in job.runs])
    if job.stream:
        return _stream_async(job, outputs)
    async with aclosing(outputs):
        async for output in outputs:
            job.builder.add(output)
    return job.builder.build()


# The create methods take ``self`` positional-only, so that a request carrying a field named
# "self" (an HTTP body passed on as keywords) is refused as an unknown field, not a TypeError.


class ChatCompletions:
    """``engine.chat.completions``."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def create(self, /, **kwargs: Any) -> Union[ChatCompletion, Iterator[ChatCompletionChunk]]:
        """Run a chat completion; keyword arguments are ``ChatCompletionRequest``'s fields.

        Returns a ``ChatCompletion``, or with ``stream=True`` an iterator of
        ``ChatCompletionChunk`` (closing it early aborts the request). Raises
        ``InvalidRequestError`` naming the field for a bad request, before generating anything.
        """
        return _run(self._backend, _prepare_chat(self._backend, kwargs))


class Completions:
    """``engine.completions``."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def create(self, /, **kwargs: Any) -> Union[Completion, Iterator[Completion]]:
        """Run a text completion; keyword arguments are ``CompletionRequest``'s fields.

        Returns a ``Completion``, or with ``stream=True`` an iterator of ``Completion`` chunks
        (closing it early aborts the request). Raises ``InvalidRequestError`` naming the field
        for a bad request, before generating anything.
        """
        return _run(self._backend, _prepare_completion(self._backend, kwargs))


class Chat:
    """``engine.chat``: holds ``completions``."""

    def __init__(self, backend: Backend) -> None:
        self.completions = ChatCompletions(backend)


class AsyncChatCompletions:
    """``engine.chat.completions`` of an async engine."""

    def __init__(self, backend: AsyncBackend) -> None:
        self._backend = backend

    async def create(self, /, **kwargs: Any) -> Union[ChatCompletion, AsyncIterator[ChatCompletionChunk]]:
        """As ``ChatCompletions.create``; a stream is an async iterator."""
        return await _run_async(self._backend, _prepare_chat(self._backend, kwargs))


class AsyncCompletions:
    """``engine.completions`` of an async engine; the prompts of a list run concurrently."""

    def __init__(self, backend: AsyncBackend) -> None:
        self._backend = backend

    async def create(self, /, **kwargs: Any) -> Union[Completion, AsyncIterator[Completion]]:
        """As ``Completions.create``; a stream is an async iterator."""
        return await _run_async(self._backend, _prepare_completion(self._backend, kwargs))


class AsyncChat:
    """``engine.chat`` of an async engine: holds ``completions``."""

    def __init__(self, backend: AsyncBackend) -> None:
        self.completions = AsyncChatCompletions(backend)

"""OpenAI's ``create`` facades on an engine: ``engine.chat.completions.create(...)`` and
``engine.completions.create(...)``.

``Chat`` / ``Completions`` (sync) and ``AsyncChat`` / ``AsyncCompletions`` validate the request
(``protocol.py``), render the chat template, run the engine requests and shape their outputs with
the builders of ``builders.py``. Everything but the iteration itself is shared between
the sync and async facades. What they need from their backend (the engine) is spelled out by
``Backend``, ``AsyncBackend`` and ``TokenizerLike`` below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Sequence
from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import Any, Optional, Protocol, TypeVar, Union

import jinja2

from lmserve.engine.stop import prepare_stops
from lmserve.errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequestError
from lmserve.frontend.limits import RequestLimits
from lmserve.frontend.openai.builders import (
    ChatResponseBuilder,
    ChatStreamBuilder,
    CompletionPrompt,
    CompletionResponseBuilder,
    CompletionStreamBuilder,
)
from lmserve.frontend.openai.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    GenerationRequest,
)
from lmserve.frontend.tools.formats import TOOL_FORMATS, ToolFormat, format_for_template
from lmserve.frontend.tools.prompt import tool_messages
from lmserve.generation_defaults import GenerationDefaults
from lmserve.outputs import RequestOutput
from lmserve.sampling_params import SamplingParams
from lmserve.structured.json_schema import SchemaError, check_schema
from lmserve.structured.params import StructuredOutputsParams
from lmserve.structured.xgrammar_lib import StructuredOutputUnavailable, xgrammar_installed
from lmserve.tokenizer import TokenBytes, hf_token_bytes

_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------------
# What the facades need from the engine


class TokenizerLike(Protocol):
    """The tokenizer calls the facades make."""

    # (Read-only properties: an implementation may hold them as attributes or properties.)

    @property
    def hf(self) -> Any:
        """The Hugging Face tokenizer: token bytes for logprobs (see ``hf_token_bytes``)."""

    @property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: a text longer than the context
        times this cannot fit, and is refused without tokenizing it."""

    @property
    def chat_template(self) -> Optional[str]:
        """The template's text, to tell its tool-call format."""

    @property
    def template_renders_tools(self) -> bool:
        """Whether the template writes the tools it is given."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Text -> token ids; ``add_special_tokens`` adds the BOS the model expects at the start."""

    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text (for ``echo`` of a prompt given as token ids)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list[dict[str, Any]]] = None,
                            add_special_tokens: bool = False) -> list[int]:
        """Chat messages (OpenAI dicts) -> prompt token ids ending with the assistant's turn;
        ``add_special_tokens`` adds the tokenizer's BOS to what the template writes."""


class _BackendBase(Protocol):
    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def model_name(self) -> str:
        """Reported in responses; a request naming another model is refused."""

    @property
    def max_model_len(self) -> int:
        """Prompt plus generated tokens must fit in this."""

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's sampling defaults for unset fields."""

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for a request the engine would refuse (any thread)."""


class Backend(_BackendBase, Protocol):
    """A sync engine: ``generate`` yields a request's outputs; closing the iterator aborts it."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> Generator[RequestOutput, None, None]: ...


class AsyncBackend(_BackendBase, Protocol):
    """An async engine: as ``Backend``, with an async iterator (closing or cancelling aborts)."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncGenerator[RequestOutput, None]: ...


# ---------------------------------------------------------------------------------------------
# Request preparation, shared by the sync and async facades


@dataclass
class PreparedRequest:
    """A request validated and tokenized, not started: the engine requests to run and the
    builder shaping their outputs. Every engine request in it has passed the engine's checks,
    so running it starts all of them or (the engine failing) none is the caller's fault."""

    runs: list[tuple[str, list[int], SamplingParams]]  # (engine request id, prompt ids, params)
    stream: bool
    builder: Union[ChatStreamBuilder, CompletionStreamBuilder, ChatResponseBuilder, CompletionResponseBuilder]

    @property
    def num_sequences(self) -> int:
        """Sequences the engine will run: prompts x n."""
        return sum(params.n for _, _, params in self.runs)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens to prefill, each prompt once per choice (the prefix cache may share them)."""
        return sum(len(prompt) * params.n for _, prompt, params in self.runs)


def _check_model(request: GenerationRequest, backend: _BackendBase) -> None:
    if request.model and request.model != backend.model_name:  # None or "": the model served
        raise InvalidRequestError(
            f"model {request.model!r} is not served here (this is {backend.model_name!r})", "model")


def _sampling_params(request: GenerationRequest, prompt_len: int, backend: _BackendBase,
                     prompt_param: str) -> SamplingParams:
    """The request's SamplingParams for one prompt, which together must fit the context; the
    model's sampling defaults fill what the request leaves unset."""
    max_model_len = backend.max_model_len
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(f"the prompt has {prompt_len} tokens, which leaves no room to generate "
                                  f"in the model's context of {max_model_len} tokens", prompt_param,
                                  CONTEXT_LENGTH_EXCEEDED)
    params = request.to_sampling_params(default_max_tokens=room, defaults=backend.generation_defaults.values)
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidRequestError(
            f"{request.max_tokens_param} is {params.max_tokens}, but the prompt has {prompt_len} tokens "
            f"and the model's context is {max_model_len} tokens, which leaves room for {room}",
            request.max_tokens_param, CONTEXT_LENGTH_EXCEEDED)
    return params


def check_text_fits(num_chars: int, backend: _BackendBase, param: str) -> None:
    """Refuse text too long for the context whatever its tokens, before paying to tokenize it."""
    most = backend.max_model_len * backend.tokenizer.max_token_chars
    if num_chars > most:
        raise InvalidRequestError(
            f"{param}: {num_chars} characters of text, more than the model's context of "
            f"{backend.max_model_len} tokens can hold (a token stands for at most "
            f"{backend.tokenizer.max_token_chars} characters)", param, CONTEXT_LENGTH_EXCEEDED)


def _validated(backend: _BackendBase, runs: list[tuple[str, list[int], SamplingParams]]) -> list:
    """``runs``, each checked as the engine would check it, so that no run starts before all pass;
    their stop strings' matcher is built here too, not on the engine thread."""
    for _, prompt, params in runs:
        backend.validate(prompt, params)
        prepare_stops(params.stop)
    return runs


def template_message(message: Any) -> dict[str, Any]:
    """An OpenAI message (a protocol model) as chat templates expect it (a plain dict)."""
    m = message.model_dump(exclude_none=True)
    if m["role"] == "developer":
        m["role"] = "system"  # OpenAI's newer name; templates only know "system"
    if isinstance(m.get("content"), list):
        m["content"] = "\n".join(part["text"] for part in m["content"])  # text parts only, as vLLM joins them
    return m


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content or ())


def _prepare_chat(backend: _BackendBase, limits: RequestLimits, kwargs: dict[str, Any]) -> PreparedRequest:
    request = ChatCompletionRequest.parse(kwargs)
    _check_model(request, backend)
    limits.check(request.stop_strings(), 1, request.n or 1)
    check_text_fits(sum(_text_chars(m.content) for m in request.messages), backend, "messages")
    tokenizer = backend.tokenizer
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    mode = request.tool_mode()
    prompt, fmt = render_chat_prompt(tokenizer, [template_message(m) for m in request.messages], tools,
                                     show_tool_prompt=mode is not None)
    if mode is not None and fmt is None:
        raise InvalidRequestError("this model's chat template writes tool calls in a format lmserve "
                                  "cannot read yet (it reads: " + ", ".join(TOOL_FORMATS) + "); send "
                                  "tool_choice 'none' to show the tools without calls", "tool_choice")
    params = _sampling_params(request, len(prompt), backend, "messages")
    if mode is not None:
        assert fmt is not None  # refused above otherwise
        params = _with_tool_grammar(params, request, fmt, mode)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    common: dict[str, Any] = dict(request_id=request_id, model=backend.model_name, created=int(time.time()),
                                  prompt_tokens=len(prompt), token_bytes=_lazy_token_bytes(tokenizer),
                                  tool_format=fmt if mode is not None else None)
    builder: Union[ChatStreamBuilder, ChatResponseBuilder] = (
        ChatStreamBuilder(**common, include_usage=request.wants_usage_chunk) if request.stream
        else ChatResponseBuilder(**common))
    return PreparedRequest(_validated(backend, [(request_id, prompt, params)]), bool(request.stream), builder)


def render_chat_prompt(tokenizer: TokenizerLike, messages: list[dict[str, Any]],
                       tools: Optional[list[dict[str, Any]]], show_tool_prompt: bool,
                       add_generation_prompt: bool = True,
                       add_special_tokens: bool = False) -> tuple[list[int], Optional[ToolFormat]]:
    """The prompt ids of a chat (template messages) with its tools (OpenAI tool dicts), as the
    chat endpoint renders it, and the tool-call format of the model (None without tools or tool
    calls in the history, which is written in that format even when no tools are sent).
    ``show_tool_prompt``: write lmserve's tool prompt where the template cannot show the tools
    (not for ``tool_choice: "none"``). Raises ``InvalidRequestError`` when the template fails."""
    calls_in_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    fmt = (format_for_template(tokenizer.chat_template, tokenizer.template_renders_tools)
           if tools or calls_in_history else None)
    if fmt is not None:
        messages, tools = tool_messages(messages, tools, fmt, tokenizer.template_renders_tools,
                                        show_tool_prompt)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools, add_special_tokens=add_special_tokens), fmt
    except (ValueError, jinja2.TemplateError) as err:  # no template, or it refuses these messages
        raise InvalidRequestError(f"cannot render the chat template: {err}", "messages") from None


def _with_tool_grammar(params: SamplingParams, request: ChatCompletionRequest, fmt: ToolFormat,
                       mode: tuple[str, Optional[str]]) -> SamplingParams:
    """``params`` with the grammar that makes the model's calls valid: calls only (``required``,
    a named function), or valid calls once it opens one (``auto``). Each tool's parameters must
    be a schema the grammar enforces. Without xgrammar, ``auto`` calls are read from free text
    and forced ones are refused."""
    functions = [t.function.model_dump(exclude_none=True) for t in request.tools or ()]
    kind, name = mode
    if not xgrammar_installed():
        if kind == "auto":
            return params
        raise StructuredOutputUnavailable("tool_choice", "it is not installed")
    chosen = [f for f in functions if kind != "function" or f["name"] == name]
    tag = fmt.structural_tag(chosen, required=kind != "auto",
                             parallel=kind != "function" and request.parallel_tool_calls is not False)
    if tag is None:
        return params
    for i, function in enumerate(functions):
        try:
            check_schema(function.get("parameters") or {})
        except SchemaError as err:
            raise InvalidRequestError(f"tools.{i}.function.parameters: the JSON schema at {err}",
                                      "tools") from None
    try:
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
            structural_tag=json.dumps(tag), origin="tools"))
    except ValueError as err:  # a combination SamplingParams refuses (min_tokens)
        raise InvalidRequestError(str(err), "tools") from None


def _prepare_completion(backend: _BackendBase, limits: RequestLimits, kwargs: dict[str, Any]) -> PreparedRequest:
    request = CompletionRequest.parse(kwargs)
    _check_model(request, backend)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    texts: Sequence[Union[str, list[int]]] = request.prompts()
    limits.check(request.stop_strings(), len(texts), request.n or 1)
    for text in texts:
        if isinstance(text, str):
            check_text_fits(len(text), backend, "prompt")
    runs: list[tuple[str, list[int], SamplingParams]] = []
    prompts: list[CompletionPrompt] = []
    for i, text in enumerate(texts):
        # A text prompt starts the sequence, so it gets the model's BOS (chat templates write theirs).
        ids = backend.tokenizer.encode(text, add_special_tokens=True) if isinstance(text, str) else list(text)
        params = _sampling_params(request, len(ids), backend, "prompt")
        run_id = request_id if len(texts) == 1 else f"{request_id}-{i}"
        echo = (text if isinstance(text, str) else backend.tokenizer.decode(ids)) if request.echo else None
        runs.append((run_id, ids, params))
        hidden = _not_echoed(backend.tokenizer, text, ids) if echo is not None and request.logprobs \
            else frozenset()
        prompts.append(CompletionPrompt(run_id, len(ids), echo, hidden))
    common: dict[str, Any] = dict(request_id=request_id, model=backend.model_name, created=int(time.time()),
                                  prompts=prompts, n=runs[0][2].n, token_bytes=_lazy_token_bytes(backend.tokenizer))
    builder: Union[CompletionStreamBuilder, CompletionResponseBuilder] = (
        CompletionStreamBuilder(**common, include_usage=request.wants_usage_chunk) if request.stream
        else CompletionResponseBuilder(**common))
    return PreparedRequest(_validated(backend, runs), bool(request.stream), builder)


def _not_echoed(tokenizer: TokenizerLike, prompt: Union[str, list[int]], ids: list[int]) -> frozenset[int]:
    """Positions of the prompt's tokens that its echoed text does not show, so that its logprobs'
    text offsets skip them: the special tokens the tokenizer put around a text's own tokens (a
    BOS before them, an EOS after where it adds one), or those that decoding token ids leaves
    out."""
    if not isinstance(prompt, str):  # decode skips every special token, named or added
        hf = tokenizer.hf
        special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
        return frozenset(i for i, t in enumerate(ids) if t in special)
    own = tokenizer.encode(prompt, add_special_tokens=False)
    before = next((k for k in range(len(ids) - len(own) + 1) if ids[k : k + len(own)] == own), None)
    if before is None:
        return frozenset()
    return frozenset(range(before)) | frozenset(range(before + len(own), len(ids)))


@functools.lru_cache(maxsize=8)
def _cached_hf_token_bytes(hf: Any) -> TokenBytes:
    return hf_token_bytes(hf)


def _lazy_token_bytes(tokenizer: TokenizerLike) -> TokenBytes:
    """``hf_token_bytes`` of the tokenizer, set up once per tokenizer and only if logprobs need it."""
    return lambda token_id: _cached_hf_token_bytes(tokenizer.hf)(token_id)


# ---------------------------------------------------------------------------------------------
# The facades: only the iteration differs between sync and async


def _generate_one_by_one(backend: Backend, job: PreparedRequest) -> Generator[RequestOutput, None, None]:
    # A sync iterator can only wait on one engine request at a time, so the prompts of a
    # multi-prompt text completion run one after the other.
    for request_id, prompt, params in job.runs:
        yield from backend.generate(prompt, params, request_id)


# The closing() / aclosing() below make leaving early (an error, or the caller dropping a stream)
# close the engine streams right away, which is what aborts their requests.


def _stream(job: PreparedRequest, outputs: Generator[RequestOutput, None, None]) -> Iterator[Any]:
    builder = job.builder
    assert isinstance(builder, (ChatStreamBuilder, CompletionStreamBuilder))  # job.stream
    with closing(outputs):
        for output in outputs:
            yield from builder.add(output)
    yield from builder.finish()


def _run(backend: Backend, job: PreparedRequest) -> Any:
    outputs = _generate_one_by_one(backend, job)
    if job.stream:
        return _stream(job, outputs)
    builder = job.builder
    assert isinstance(builder, (ChatResponseBuilder, CompletionResponseBuilder))  # not job.stream
    with closing(outputs):
        for output in outputs:
            builder.add(output)
    return builder.build()


async def _merge(streams: Sequence[AsyncIterator[_T]]) -> AsyncGenerator[_T, None]:
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


async def _stream_async(job: PreparedRequest, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[Any]:
    builder = job.builder
    assert isinstance(builder, (ChatStreamBuilder, CompletionStreamBuilder))  # job.stream
    async with aclosing(outputs):
        async for output in outputs:
            for chunk in builder.add(output):
                yield chunk
    for chunk in builder.finish():
        yield chunk


async def _run_async(backend: AsyncBackend, job: PreparedRequest) -> Any:
    streams = [backend.generate(prompt, params, run_id) for run_id, prompt, params in job.runs]
    # One engine request (one prompt): its own stream, without _merge's task and queue per output.
    outputs = streams[0] if len(streams) == 1 else _merge(streams)
    if job.stream:
        return _stream_async(job, outputs)
    builder = job.builder
    assert isinstance(builder, (ChatResponseBuilder, CompletionResponseBuilder))  # not job.stream
    async with aclosing(outputs):
        async for output in outputs:
            builder.add(output)
    return builder.build()


# The create methods take ``self`` positional-only, so that a request carrying a field named
# "self" (an HTTP body passed on as keywords) is refused as an unknown field, not a TypeError.


class _Facade:
    """What every facade holds: its backend and the limits its requests must keep."""

    _prepare: Callable[[Any, RequestLimits, dict[str, Any]], PreparedRequest]

    def __init__(self, backend: Any, limits: Optional[RequestLimits] = None) -> None:
        self._backend = backend
        self._limits = limits or RequestLimits()

    def prepare(self, /, **kwargs: Any) -> PreparedRequest:
        """Validate and tokenize a request without starting it (blocking: tokenizing and the
        chat template take time on long texts). Raises ``InvalidRequestError`` naming the field."""
        return type(self)._prepare(self._backend, self._limits, kwargs)


class ChatCompletions(_Facade):
    """``engine.chat.completions``."""

    _prepare = staticmethod(_prepare_chat)

    def create(self, /, **kwargs: Any) -> Union[ChatCompletion, Iterator[ChatCompletionChunk]]:
        """Run a chat completion; keyword arguments are ``ChatCompletionRequest``'s fields.

        Returns a ``ChatCompletion``, or with ``stream=True`` an iterator of
        ``ChatCompletionChunk`` (closing it early aborts the request). Raises
        ``InvalidRequestError`` naming the field for a bad request, before generating anything.
        """
        return _run(self._backend, self.prepare(**kwargs))


class Completions(_Facade):
    """``engine.completions``."""

    _prepare = staticmethod(_prepare_completion)

    def create(self, /, **kwargs: Any) -> Union[Completion, Iterator[Completion]]:
        """Run a text completion; keyword arguments are ``CompletionRequest``'s fields.

        Returns a ``Completion``, or with ``stream=True`` an iterator of ``Completion`` chunks
        (closing it early aborts the request). Raises ``InvalidRequestError`` naming the field
        for a bad request, before generating anything.
        """
        return _run(self._backend, self.prepare(**kwargs))


class Chat:
    """``engine.chat``: holds ``completions``."""

    def __init__(self, backend: Backend, limits: Optional[RequestLimits] = None) -> None:
        self.completions = ChatCompletions(backend, limits)


class _AsyncFacade(_Facade):
    async def prepare_async(self, /, **kwargs: Any) -> PreparedRequest:
        """``prepare`` in a worker thread: tokenizing a long text must not hold up the event loop."""
        return await asyncio.to_thread(functools.partial(self.prepare, **kwargs))

    async def run(self, prepared: PreparedRequest) -> Any:
        """Run a prepared request: the response, or for a stream an async iterator of chunks."""
        return await _run_async(self._backend, prepared)


class AsyncChatCompletions(_AsyncFacade):
    """``engine.chat.completions`` of an async engine."""

    _prepare = staticmethod(_prepare_chat)

    async def create(self, /, **kwargs: Any) -> Union[ChatCompletion, AsyncIterator[ChatCompletionChunk]]:
        """As ``ChatCompletions.create``; a stream is an async iterator."""
        return await self.run(await self.prepare_async(**kwargs))


class AsyncCompletions(_AsyncFacade):
    """``engine.completions`` of an async engine; the prompts of a list run concurrently."""

    _prepare = staticmethod(_prepare_completion)

    async def create(self, /, **kwargs: Any) -> Union[Completion, AsyncIterator[Completion]]:
        """As ``Completions.create``; a stream is an async iterator."""
        return await self.run(await self.prepare_async(**kwargs))


class AsyncChat:
    """``engine.chat`` of an async engine: holds ``completions``."""

    def __init__(self, backend: AsyncBackend, limits: Optional[RequestLimits] = None) -> None:
        self.completions = AsyncChatCompletions(backend, limits)

"""Pydantic models of the OpenAI chat and text completion APIs, as lmserve accepts and returns them.

Requests carry OpenAI's fields and vLLM's sampling extensions; unknown fields are refused at
every level (a typo must not silently change a generation). ``parse`` validates the shapes,
``to_sampling_params`` the combinations and OpenAI's defaults (an explicit ``null`` is the same
as leaving a field out); every failure is an ``InvalidRequestError`` naming the field.
Responses have the field names and nesting of the official ``openai`` package's types, plus
vLLM's ``stop_reason`` on each choice.
"""

from __future__ import annotations

import json as _json
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lmserve.errors import InvalidRequestError
from lmserve.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    SamplingParams,
)
from lmserve.structured.params import StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on choices per request
# Levels of nested lists and objects in a request. A tool's parameter schema nested 900 deep
# passed the JSON parser and then overflowed the stack of whatever walked it (a 500).
MAX_NESTING = 64


def invalid_request(err: ValidationError, data: Any) -> InvalidRequestError:
    """Pydantic's errors on the request ``data`` as one ``InvalidRequestError``, each prefixed by
    its dotted path in ``data``; ``param`` is the top-level request field."""
    errors = err.errors(include_url=False)
    lines = []
    for e in errors:
        where = ".".join(map(str, _path_in_request(e["loc"], data, e["type"] == "missing"))) or "request"
        what = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{where}: {what}")
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
    return InvalidRequestError("; ".join(lines), param)


def _path_in_request(loc: tuple, data: Any, missing: bool) -> list:
    """Pydantic's error location as a path in the request: without the names it gives the
    members of a union (``stop.str``, the ``json_schema`` tag of ``response_format``), which are
    no place in the request. A ``missing`` field's name ends the path though it is not there."""
    path, value = [], data
    for i, part in enumerate(loc):
        if isinstance(value, dict) and part in value or (
                isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)):
            path.append(part)
            value = value[part]
        elif missing and i == len(loc) - 1:
            path.append(part)
    return path


def check_json_values(data: Any, max_nesting: int = MAX_NESTING) -> None:
    """Refuse what JSON lets through but no request may hold: nesting deeper than
    ``max_nesting`` levels, and strings with lone UTF-16 surrogates (``"\\ud800"`` is valid JSON
    but not Unicode: no tokenizer or UTF-8 encoder takes it). Raises ``InvalidRequestError``
    naming the path of the value at fault."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                where = ".".join(map(str, path)) or "request"
                raise InvalidRequestError(
                    f"{where}: the text holds a lone UTF-16 surrogate (U+{ord(value[err.start]):04X} at "
                    f"character {err.start}), which is not valid Unicode", str(path[0]) if path else None
                ) from None
            continue
        if isinstance(value, dict):
            items = [(k, v) for k, v in value.items()] + [(k, k) for k in value if isinstance(k, str)]
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        else:
            continue
        if depth >= max_nesting:
            where = ".".join(map(str, path[:6])) + (".…" if len(path) > 6 else "")
            raise InvalidRequestError(f"{where}: nested deeper than this server's limit of "
                                      f"{max_nesting} levels", str(path[0]) if path else None)
        stack.extend((v, (*path, k), depth + 1) for k, v in items)


class _Strict(BaseModel):
    """Base of every request-side model: unknown fields are an error, not silently dropped, and
    values are taken as they are typed (``"2"`` is no int, ``true`` no 1, ``"yes"`` no bool), as
    OpenAI's API takes them."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------------------------------
# Chat messages


class TextContentPart(_Strict):
    """A text part of a message whose content is a list of parts (the only kind we accept)."""

    type: Literal["text"]
    text: str


MessageContent = Union[str, list[TextContentPart]]


class SystemMessage(_Strict):
    """Instructions for the model; ``developer`` is OpenAI's newer name for the same role."""

    role: Literal["system", "developer"]
    content: MessageContent
    name: Optional[str] = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: MessageContent
    name: Optional[str] = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Optional[MessageContent] = None
    name: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str
    name: Optional[str] = None  # the function's name, as OpenAI's cookbook sends it


ChatMessageParam = Annotated[
    Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage],
    Field(discriminator="role"),
]


# ---------------------------------------------------------------------------------------------
# Shape-only request options: response_format, tools, tool_choice, stream_options


class TextResponseFormat(_Strict):
    type: Literal["text"]


class JsonObjectResponseFormat(_Strict):
    type: Literal["json_object"]


class JsonSchema(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: Optional[str] = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    Union[TextResponseFormat, JsonObjectResponseFormat, JsonSchemaResponseFormat],
    Field(discriminator="type"),
]


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` request field: exactly one constraint (see
    ``lmserve.structured.params.StructuredOutputsParams``)."""

    # "json" would shadow a BaseModel attribute, hence the alias (the only name a request may use).
    json_value: Union[dict[str, Any], str, None] = Field(None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    structural_tag: Union[str, dict[str, Any], None] = None
    disable_any_whitespace: Optional[bool] = None

    def to_params(self) -> StructuredOutputsParams:
        tag = self.structural_tag
        fields = self.model_dump(exclude_none=True, by_alias=True)
        if isinstance(tag, dict):
            fields["structural_tag"] = _json.dumps(tag)
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as err:
            raise InvalidRequestError(str(err), "structured_outputs") from None


class FunctionDefinition(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # JSON schema of the arguments
    strict: Optional[bool] = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None  # send a last chunk with the usage of the whole request


# ---------------------------------------------------------------------------------------------
# Requests

_Probability = Annotated[float, Field(ge=0.0, le=1.0)]
_Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
_TokenId = Annotated[int, Field(ge=0)]
_TokenIdKey = Annotated[int, Field(ge=0, strict=False)]  # JSON object keys are strings: "50256"
_R = TypeVar("_R", bound="GenerationRequest")


class GenerationRequest(_Strict):
    """The fields chat and text completion requests share, and their mapping to SamplingParams."""

    model: Optional[str] = None  # None or "": whichever model is served
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)], None] = None
    seed: Optional[Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]] = None
    presence_penalty: Optional[_Penalty] = None
    frequency_penalty: Optional[_Penalty] = None
    # OpenAI sends the token ids as JSON object keys, i.e. strings; pydantic parses them to int.
    logit_bias: Optional[dict[_TokenIdKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]] = None
    user: Optional[str] = None  # accepted for compatibility, not used
    # lmserve extensions (vLLM spelling)
    top_k: Optional[Annotated[int, Field(ge=-1)]] = None  # -1 or 0: no top-k cut
    min_p: Optional[_Probability] = None
    repetition_penalty: Optional[
        Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]
    ] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[_TokenId]] = None
    min_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    structured_outputs: Optional[StructuredOutputs] = None

    @classmethod
    def parse(cls: type[_R], data: Any) -> _R:
        """Validate a request body (a mapping), raising ``InvalidRequestError`` naming the field."""
        check_json_values(data)
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise invalid_request(err, data) from None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: Union[str, list[str], None]) -> Union[str, list[str], None]:
        # An empty stop string would end every choice before its first token.
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    def stop_strings(self) -> list[str]:
        """The stop strings, as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def wants_usage_chunk(self) -> bool:
        """Whether a stream should end with a chunk carrying the usage of the whole request."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _requested_max_tokens(self) -> Optional[int]:
        """The caller's limit on generated tokens per choice; chat adds its newer spelling."""
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The name under which the caller gave the token limit, for error messages."""
        return "max_tokens"

    def _logprobs(self) -> Optional[int]:
        """SamplingParams.logprobs: None, or how many top alternatives to report per token."""
        raise NotImplementedError

    def _prompt_logprobs(self) -> Optional[int]:
        """SamplingParams.prompt_logprobs: None, or how many top alternatives per prompt token."""
        return None

    def _structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """SamplingParams.structured_outputs: the constraint the request asks for, if any."""
        return self.structured_outputs.to_params() if self.structured_outputs else None

    def _check(self) -> None:
        """Cross-field checks; raise InvalidRequestError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")

    def to_sampling_params(self, default_max_tokens: Optional[int],
                           defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        """Map the request to SamplingParams with OpenAI's defaults.

        ``default_max_tokens`` is used when the request sets no limit (the server passes what the
        context window leaves after the prompt); None leaves SamplingParams' own default.
        ``defaults``: the model's sampling defaults (``GenerationDefaults.values``), used for
        the fields the request leaves unset, before OpenAI's.
        """
        model = defaults or {}
        self._check()
        max_tokens = self._requested_max_tokens()
        if max_tokens is None:
            max_tokens = default_max_tokens
        if self.min_tokens is not None and max_tokens is not None and self.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) exceeds the token limit ({max_tokens})", "min_tokens"
            )
        kwargs: dict[str, Any] = dict(
            n=1 if self.n is None else self.n,
            temperature=model.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=model.get("top_p", 1.0) if self.top_p is None else self.top_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop=self.stop_strings(),
            logprobs=self._logprobs(),
        )
        # Fields OpenAI has no default for, and the extensions: only when set, so that
        # SamplingParams' own defaults (whatever "disabled" means there) stay in charge.
        optional = dict(
            max_tokens=max_tokens,
            prompt_logprobs=self._prompt_logprobs(),
            seed=self.seed,
            logit_bias=self.logit_bias,
            top_k=model.get("top_k") if self.top_k is None else self.top_k,
            min_p=model.get("min_p") if self.min_p is None else self.min_p,
            repetition_penalty=model.get("repetition_penalty") if self.repetition_penalty is None
            else self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self._structured_outputs(),
        )
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**kwargs)
        except ValueError as err:  # a combination only SamplingParams knows to refuse
            raise InvalidRequestError(str(err)) from None


class ChatCompletionRequest(GenerationRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None  # newer name of max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None  # OpenAI's default: true

    def tool_mode(self) -> Optional[tuple[str, Optional[str]]]:
        """How the answer may call tools: None (no tools, or ``tool_choice: "none"``),
        ``("auto", None)`` (OpenAI's default with tools), ``("required", None)``, or
        ``("function", name)`` for the one function it must call."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return "function", choice.function.name
        return choice or "auto", None

    def _check(self) -> None:
        super()._check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError(
                "give max_completion_tokens or its deprecated alias max_tokens, not both", "max_tokens"
            )
        formatted = self.response_format is not None and self.response_format.type != "text"
        constrained = formatted or self.structured_outputs is not None
        if formatted and self.structured_outputs is not None:
            raise InvalidRequestError("give response_format or structured_outputs, not both",
                                      "structured_outputs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        mode = self.tool_mode()
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools: two tools have the same name", "tools")
        if mode is not None and mode[0] == "function" and mode[1] not in names:
            raise InvalidRequestError(f"tool_choice names function {mode[1]!r}, which is not among "
                                      f"the tools ({', '.join(names)})", "tool_choice")
        if mode is not None and constrained:
            raise InvalidRequestError("a structured answer (response_format or structured_outputs) "
                                      "cannot be combined with tool calls; send tool_choice 'none'",
                                      "tool_choice")

    def _structured_outputs(self) -> Optional[StructuredOutputsParams]:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return super()._structured_outputs()
        if fmt.type == "json_schema" and fmt.json_schema.json_schema is not None:
            return StructuredOutputsParams(json=fmt.json_schema.json_schema, origin="response_format")
        return StructuredOutputsParams(json_object=True, origin="response_format")

    def _requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"

    def _logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = Union[
    Annotated[str, Field(min_length=1)],
    Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
    Annotated[list[_TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[_TokenId], Field(min_length=1)]], Field(min_length=1)],
]


class CompletionRequest(GenerationRequest):
    """Body of ``POST /v1/completions``. A list of prompts gives ``n`` choices per prompt."""

    prompt: Prompt
    # Prepend the prompt to each choice's text; with ``logprobs``, its tokens and their logprobs
    # to the choice's logprobs (with ``max_tokens: 0``: score the prompt, generate nothing).
    echo: Optional[bool] = None
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    # OpenAI allows 5 here; we allow as many as for chat. Strict, so that chat's ``logprobs: true``
    # is refused rather than read as 1.
    logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]] = None
    suffix: Optional[str] = None  # insertion mode: refused, the models we serve do not do it

    def _check(self) -> None:
        super()._check()
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported", "suffix")

    def _logprobs(self) -> Optional[int]:
        return self.logprobs

    def _prompt_logprobs(self) -> Optional[int]:
        return self.logprobs if self.echo else None

    def prompts(self) -> Union[list[str], list[list[int]]]:
        """The prompt as a list of prompts: strings, or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return p


# ---------------------------------------------------------------------------------------------
# Responses

FinishReason = Literal["stop", "length", "tool_calls"]
StopReason = Union[int, str, None]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int  # over all choices
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None  # the token's UTF-8 bytes (a token may be part of a character)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # best first; may hold fewer than top_logprobs entries


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None
    refusal: Optional[list[ChatTokenLogprob]] = None


class ChatFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ChatFunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[ChatToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: FinishReason
    stop_reason: StopReason = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class ChatDeltaFunction(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ChatDeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first piece of each ``index`` has id, type and name,
    the next ones add to its ``arguments``."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: ChatDeltaFunction


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None  # only on a choice's first chunk
    content: Optional[str] = None
    tool_calls: Optional[list[ChatDeltaToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None  # set on the choice's last chunk
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty in the final usage chunk
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]  # null for an echoed prompt's first token
    top_logprobs: list[Optional[dict[str, float]]]  # token text -> logprob, per position
    text_offset: list[int]  # where each token starts in the choice's text


class CompletionChoice(BaseModel):
    index: int  # prompt index * n + choice index within the prompt
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReason] = None  # None only in stream chunks before the last
    stop_reason: StopReason = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None  # always set on the full response; on a stream's usage chunk
    system_fingerprint: Optional[str] = None

"""OpenAI-shaped results over a scripted backend: shapes match the official ``openai`` types."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import openai.types
import openai.types.chat
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from lmserve.errors import InvalidRequestError
from lmserve.frontend.openai.builders import (
    ChatResponseBuilder,
    ChatStreamBuilder,
    RequestAborted,
    token_text,
)
from lmserve.frontend.openai.facades import AsyncChat, AsyncCompletions, Chat, Completions
from lmserve.generation_defaults import GenerationDefaults
from lmserve.outputs import RequestOutput, SequenceDelta, TokenLogprob
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import hf_token_bytes

BOS = 1
FILE_SEP = 5
MESSAGES = [{"role": "user", "content": "Hi"}]


class FakeHF:
    """A character vocabulary: token id = code point, spelled SentencePiece-style."""

    def convert_ids_to_tokens(self, ids):  # like Hugging Face's: one id or a list of them
        return chr(ids) if isinstance(ids, int) else [chr(i) for i in ids]

    all_special_ids = [BOS]
    # An added special token outside the named ones (as SmolLM2's <file_sep>): decode skips it.
    added_tokens_decoder = {FILE_SEP: AddedToken("\x05", special=True)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def get_added_vocab(self) -> dict[str, int]:
        return {}


class FakeTokenizer:
    max_token_chars = 1  # one character a token
    chat_template = "<tool_call>"  # reads as a Hermes-style template
    template_renders_tools = True

    def __init__(self) -> None:
        self.hf = FakeHF()
        self.rendered: list[tuple[list[dict], Optional[list[dict]]]] = []

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [BOS] * add_special_tokens + [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t not in (BOS, FILE_SEP))

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None,
                            add_special_tokens=False) -> list[int]:
        self.rendered.append((messages, tools))
        text = "".join(f"<{m['role']}>{m.get('content', '')}" for m in messages)
        return self.encode(text + "<assistant>" * add_generation_prompt, add_special_tokens)


def reply(prompt_ids: list[int], index: int) -> str:
    """What the fake model answers: differs per prompt and per choice, choices of different lengths."""
    return f"{len(prompt_ids)}é{index}" + "ab" * index


def scripted(request_id: str, prompt_ids: list[int], params: SamplingParams, finish: str = "length",
             stop_reason: Any = None) -> list[RequestOutput]:
    """One character (= one token) per step for each choice, as the engine would report them;
    with ``max_tokens=0`` one step of empty deltas; prompt logprobs (-0.5 each) with the first."""
    if params.max_tokens == 0:
        return [RequestOutput(request_id, prompt_ids, [
            SequenceDelta(i, "", [], None if params.logprobs is None else [], "length")
            for i in range(params.n)], finished=True, prompt_logprobs=fake_prompt_logprobs(prompt_ids, params))]
    replies = [reply(prompt_ids, i) for i in range(params.n)]
    steps = max(len(r) for r in replies)
    outputs = []
    for step in range(steps):
        deltas = []
        for i, text in enumerate(replies):
            if step >= len(text):
                continue
            token, last = ord(text[step]), step == len(text) - 1
            logprobs = None
            if params.logprobs is not None:
                top = [(token, -0.25), (ord("?"), float("-inf"))][: params.logprobs]
                logprobs = [TokenLogprob(token, -0.25, top)]
            deltas.append(SequenceDelta(i, text[step], [token], logprobs, finish if last else None,
                                        stop_reason if last else None))
        outputs.append(RequestOutput(request_id, prompt_ids, deltas, finished=step == steps - 1))
    outputs[0].prompt_logprobs = fake_prompt_logprobs(prompt_ids, params)
    return outputs


def fake_prompt_logprobs(prompt_ids: list[int], params: SamplingParams) -> Optional[list]:
    if params.prompt_logprobs is None:
        return None
    return [None] + [TokenLogprob(t, -0.5, [(t, -0.5)][: params.prompt_logprobs]) for t in prompt_ids[1:]]


class FakeBackend:
    model_name = "fake-model"
    max_model_len = 64
    generation_defaults = GenerationDefaults()  # OpenAI's defaults

    def __init__(self, script=scripted) -> None:
        self.tokenizer = FakeTokenizer()
        self.script = script
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []

    def validate(self, prompt_token_ids, params):
        if any(t >= 0x110000 for t in prompt_token_ids):  # as the engine refuses ids past its vocabulary
            raise InvalidRequestError(f"prompt token id {max(prompt_token_ids)} is outside the vocabulary",
                                      "prompt")

    def generate(self, prompt_token_ids, params, request_id):
        self.calls.append((request_id, prompt_token_ids, params))
        finished = False
        try:
            for output in self.script(request_id, prompt_token_ids, params):
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.aborted.append(request_id)


class AsyncFakeBackend(FakeBackend):
    async def generate(self, prompt_token_ids, params, request_id):
        self.calls.append((request_id, prompt_token_ids, params))
        finished = False
        try:
            for output in self.script(request_id, prompt_token_ids, params):
                await asyncio.sleep(0)  # let other requests interleave
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.aborted.append(request_id)


def as_openai(response, openai_type):
    """Parse our response's JSON with the official client's type (raises if the shape is off)."""
    return openai_type.model_validate(json.loads(response.model_dump_json()))


def as_openai_completion_chunk(chunk):
    # OpenAI streams finish_reason null until a choice's last chunk, but the SDK shares one type
    # with whole responses, where it is required; fill it in to check everything else.
    data = json.loads(chunk.model_dump_json())
    for choice in data["choices"]:
        choice["finish_reason"] = choice["finish_reason"] or "length"
    return openai.types.Completion.model_validate(data)


def chat_create(backend=None, **kwargs):
    return Chat(backend or FakeBackend()).completions.create(**{"messages": MESSAGES, **kwargs})


def prompt_len() -> int:
    return len(FakeTokenizer().apply_chat_template(MESSAGES))


# ---------------------------------------------------------------------------------------------
# Chat


def test_chat_response_matches_openai_type_and_counts_usage_over_choices():
    response = chat_create(n=3, max_tokens=20)
    parsed = as_openai(response, openai.types.chat.ChatCompletion)
    n_prompt = prompt_len()
    assert [c.message.content for c in parsed.choices] == [reply([0] * n_prompt, i) for i in range(3)]
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in parsed.choices)
    completion_tokens = sum(len(reply([0] * n_prompt, i)) for i in range(3))
    assert parsed.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": n_prompt, "completion_tokens": completion_tokens,
        "total_tokens": n_prompt + completion_tokens}
    assert parsed.object == "chat.completion" and parsed.model == "fake-model"
    assert parsed.id.startswith("chatcmpl-")


def test_chat_stream_chunks_match_openai_type_and_the_full_response():
    chunks = list(chat_create(n=2, stream=True))
    parsed = [as_openai(c, openai.types.chat.ChatCompletionChunk) for c in chunks]
    assert len({(c.id, c.created) for c in parsed}) == 1
    by_choice: dict[int, list] = {}
    for chunk in parsed:
        assert len(chunk.choices) == 1 and chunk.usage is None
        by_choice.setdefault(chunk.choices[0].index, []).append(chunk.choices[0])
    full = chat_create(n=2)
    for index, parts in by_choice.items():
        # The role alone first and the finish reason alone last, as OpenAI sends them: a client
        # that reads the first chunk for the role only loses no text.
        assert parts[0].delta.model_dump(exclude_none=True) == {"role": "assistant", "content": ""}
        assert all(p.delta.role is None for p in parts[1:])
        assert [p.finish_reason for p in parts] == [None] * (len(parts) - 1) + ["length"]
        assert parts[-1].delta.model_dump(exclude_none=True) == {}
        assert all(p.delta.content for p in parts[1:-1])
        assert "".join(p.delta.content or "" for p in parts) == full.choices[index].message.content


def test_chat_stream_usage_chunk_when_asked():
    chunks = list(chat_create(n=2, stream=True, stream_options={"include_usage": True}))
    last = as_openai(chunks[-1], openai.types.chat.ChatCompletionChunk)
    assert last.choices == [] and last.usage.total_tokens == chat_create(n=2).usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_shape():
    response = chat_create(logprobs=True, top_logprobs=2)
    parsed = as_openai(response, openai.types.chat.ChatCompletion)
    content = parsed.choices[0].logprobs.content
    text = parsed.choices[0].message.content
    assert [t.token for t in content] == list(text)
    assert b"".join(bytes(t.bytes) for t in content) == text.encode()
    accented = content[text.index("é")]
    assert (accented.token, accented.bytes) == ("é", [0xC3, 0xA9])
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [(text[0], -0.25), ("?", -9999.0)]
    streamed = [c.choices[0].logprobs.content for c in chat_create(logprobs=True, top_logprobs=2, stream=True)
                if c.choices[0].logprobs]
    assert [t for part in streamed for t in part] == response.choices[0].logprobs.content


def test_chat_without_logprobs_has_none():
    assert chat_create().choices[0].logprobs is None


def test_chat_logprobs_without_top_gives_empty_alternatives():
    content = chat_create(logprobs=True).choices[0].logprobs.content
    assert all(t.top_logprobs == [] for t in content)


def test_chat_request_reaches_the_backend():
    backend = FakeBackend()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    chat_create(backend, messages=messages, tools=tools, tool_choice="none", temperature=0, stop=["x"], seed=3)
    rendered, rendered_tools = backend.tokenizer.rendered[0]
    assert rendered == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert rendered_tools == tools
    request_id, prompt, params = backend.calls[0]
    assert prompt == backend.tokenizer.apply_chat_template(rendered)
    assert (params.temperature, params.stop, params.seed) == (0.0, ["x"], 3)
    assert params.max_tokens == FakeBackend.max_model_len - len(prompt)  # the rest of the context
    assert request_id.startswith("chatcmpl-")


def test_stop_reason_is_reported():
    backend = FakeBackend(lambda *a: scripted(*a, finish="stop", stop_reason="###"))
    choice = chat_create(backend).choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", "###")


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "messages"),
    ({"max_tokens": 10, "temperatur": 1}, "temperatur"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"model": "gpt-4o"}, "model"),
    ({"max_tokens": 1000}, "max_tokens"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 100}]}, "messages"),
])
def test_bad_chat_requests_name_the_field_before_generating(kwargs, param):
    backend = FakeBackend()
    with pytest.raises(InvalidRequestError) as info:
        chat_create(backend, **kwargs)
    assert info.value.param == param
    assert backend.calls == []


def test_bad_stream_request_fails_at_create_not_at_iteration():
    with pytest.raises(InvalidRequestError):
        chat_create(stream=True, n=0)


def test_template_refusal_is_a_request_error():
    backend = FakeBackend()

    def refuse(*args, **kwargs):
        raise ValueError("no chat template")

    backend.tokenizer.apply_chat_template = refuse
    with pytest.raises(InvalidRequestError) as info:
        chat_create(backend)
    assert info.value.param == "messages"


def test_aborted_request_raises():
    backend = FakeBackend(lambda *a: scripted(*a, finish="abort"))
    with pytest.raises(RequestAborted):
        chat_create(backend)
    with pytest.raises(RequestAborted):
        list(chat_create(backend, stream=True))


def test_leaving_a_stream_early_aborts_the_request():
    backend = FakeBackend()
    stream = chat_create(backend, stream=True)
    next(stream)
    stream.close()
    assert backend.aborted == [backend.calls[0][0]]


# ---------------------------------------------------------------------------------------------
# Builders, directly


def test_steps_without_visible_news_yield_no_chunk():
    builder = ChatStreamBuilder("id", "m", 0, prompt_tokens=4, token_bytes=lambda t: b"")

    def out(*deltas):
        return RequestOutput("id", [0] * 4, list(deltas), finished=False)

    first = builder.add(out(SequenceDelta(0, "", [5])))  # the first chunk carries the role even if empty
    assert [c.choices[0].delta.model_dump(exclude_none=True) for c in first] == [{"role": "assistant", "content": ""}]
    assert builder.add(out(SequenceDelta(0, "", [6]))) == []  # text held back as a possible stop string
    last = builder.add(out(SequenceDelta(0, "", [7], finish_reason="stop", stop_reason=7)))
    assert last[0].choices[0].delta.content is None and last[0].choices[0].finish_reason == "stop"
    assert builder.usage.model_dump() == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_response_builder_refuses_unfinished_choices():
    builder = ChatResponseBuilder("id", "m", 0, prompt_tokens=1, token_bytes=lambda t: b"")
    builder.add(RequestOutput("id", [0], [SequenceDelta(0, "a", [97])], finished=False))
    with pytest.raises(RuntimeError, match="before choice 0 finished"):
        builder.build()


# ---------------------------------------------------------------------------------------------
# Text completions


def completion_create(backend=None, **kwargs):
    return Completions(backend or FakeBackend()).create(**{"prompt": "Hello", **kwargs})


def test_completion_response_matches_openai_type():
    backend = FakeBackend()
    parsed = as_openai(completion_create(backend, n=2), openai.types.Completion)
    prompt = [BOS] + [ord(c) for c in "Hello"]
    assert backend.calls[0][1] == prompt  # a text prompt gets the BOS
    assert [c.text for c in parsed.choices] == [reply(prompt, 0), reply(prompt, 1)]
    assert parsed.usage.prompt_tokens == len(prompt)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")


def test_completion_several_prompts_give_n_choices_each():
    backend = FakeBackend()
    response = completion_create(backend, prompt=[[5, 6], [7, 8, 9]], n=2)
    parsed = as_openai(response, openai.types.Completion)
    assert [c.index for c in parsed.choices] == [0, 1, 2, 3]
    assert [c.text for c in parsed.choices] == [reply([5, 6], 0), reply([5, 6], 1),
                                                reply([7, 8, 9], 0), reply([7, 8, 9], 1)]
    generated = sum(len(c.text) for c in parsed.choices)
    assert parsed.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 5, "completion_tokens": generated, "total_tokens": 5 + generated}
    assert len({request_id for request_id, _, _ in backend.calls}) == 2


def test_completion_stream_matches_openai_type_and_the_full_response():
    kwargs = dict(prompt=["ab", "cde"], n=2, stream_options={"include_usage": True})
    chunks = list(completion_create(stream=True, **kwargs))
    full = completion_create(**{k: v for k, v in kwargs.items() if k != "stream_options"})
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        parsed = as_openai_completion_chunk(chunk)
        assert chunk.usage is None and len(parsed.choices) == 1
        texts[parsed.choices[0].index] = texts.get(parsed.choices[0].index, "") + parsed.choices[0].text
    assert texts == {c.index: c.text for c in full.choices}
    last = as_openai(chunks[-1], openai.types.Completion)
    assert last.choices == [] and last.usage.model_dump(exclude_none=True) == full.usage.model_dump()


@pytest.mark.parametrize("logprobs, top", [(0, {}), (1, {}), (2, {"?": -9999.0})])
def test_completion_logprobs_shape(logprobs, top):
    response = completion_create(logprobs=logprobs)
    lp = as_openai(response, openai.types.Completion).choices[0].logprobs
    text = response.choices[0].text
    assert lp.tokens == list(text)
    assert lp.token_logprobs == [-0.25] * len(text)
    # The chosen token is always there, as in OpenAI's API (with logprobs 0, only it).
    assert lp.top_logprobs == [{c: -0.25, **top} for c in text]
    assert lp.text_offset == list(range(len(text)))
    chunks = list(completion_create(logprobs=logprobs, stream=True))
    streamed = [c.choices[0].logprobs.tokens for c in chunks[:-1]]
    assert [t for part in streamed for t in part] == lp.tokens
    last = chunks[-1].choices[0]  # the finish reason in a chunk of its own
    assert (last.text, last.logprobs, last.finish_reason) == ("", None, "length")


def test_completion_echo_with_logprobs_scores_the_prompt():
    """As lm-evaluation-harness's ``local-completions`` asks: the prompt's tokens and their
    logprobs (the first has none) before the choice's own, text offsets over the echoed text."""
    backend = FakeBackend()
    response = completion_create(backend, prompt="Hi", echo=True, logprobs=1, max_tokens=0)
    assert backend.calls[0][2].prompt_logprobs == 1 and backend.calls[0][2].max_tokens == 0
    # null for the first token, as OpenAI's legacy API and vLLM send it (the openai package's
    # types say float, but its client does not validate responses)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == ("Hi", "length")
    assert choice.logprobs.tokens == ["\x01", "H", "i"]  # the BOS spelled as the fake spells it
    assert choice.logprobs.token_logprobs == [None, -0.5, -0.5]
    assert choice.logprobs.top_logprobs == [None, {"H": -0.5}, {"i": -0.5}]
    assert choice.logprobs.text_offset == [0, 0, 1]  # into the text: the BOS is not in it
    ids = completion_create(backend, prompt=[BOS, ord("H"), FILE_SEP, ord("i")], echo=True, logprobs=1,
                            max_tokens=0)
    assert ids.choices[0].text == "Hi" and ids.choices[0].logprobs.text_offset == [0, 0, 1, 1]
    # A tokenizer that also ends a text with an EOS (spelled "\x02" by the fake): no room either.
    backend.tokenizer.encode = lambda text, add_special_tokens: (
        [BOS] * add_special_tokens + [ord(c) for c in text] + [2] * add_special_tokens)
    both = completion_create(backend, prompt="Hi", echo=True, logprobs=1, max_tokens=0)
    assert both.choices[0].text == "Hi" and both.choices[0].logprobs.text_offset == [0, 0, 1, 2]

    full = completion_create(prompt="Hi", echo=True, logprobs=1, n=2)
    for choice in full.choices:
        generated = reply([BOS, ord("H"), ord("i")], choice.index)
        assert choice.text == "Hi" + generated
        assert choice.logprobs.token_logprobs == [None, -0.5, -0.5] + [-0.25] * len(generated)
        assert choice.logprobs.text_offset[3:] == list(range(2, 2 + len(generated)))
    chunks = list(completion_create(prompt="Hi", echo=True, logprobs=1, n=2, stream=True))
    firsts = {}
    for chunk in chunks:
        firsts.setdefault(chunk.choices[0].index, chunk.choices[0])
    assert all(c.logprobs.tokens[:3] == ["\x01", "H", "i"] for c in firsts.values())
    assert completion_create(echo=False, logprobs=1).choices[0].logprobs.token_logprobs[0] == -0.25


def test_completion_echo_prepends_the_prompt():
    assert completion_create(echo=True).choices[0].text.startswith("Hello")
    assert completion_create(prompt=[72, 105], echo=True).choices[0].text.startswith("Hi")
    first = next(iter(completion_create(echo=True, stream=True)))
    assert first.choices[0].text.startswith("Hello")


@pytest.mark.parametrize("kwargs, param", [
    ({"suffix": "x"}, "suffix"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", "x" * 100]}, "prompt"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"logprobs": True}, "logprobs"),
])
def test_bad_completion_requests_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        completion_create(**kwargs)
    assert info.value.param == param


# ---------------------------------------------------------------------------------------------
# Async facades


def test_async_chat_gives_the_sync_results():
    async def main():
        chat = AsyncChat(AsyncFakeBackend()).completions
        full = await chat.create(messages=MESSAGES, n=2, logprobs=True)
        stream = await chat.create(messages=MESSAGES, n=2, stream=True,
                                   stream_options={"include_usage": True})
        return full, [c async for c in stream]

    full, chunks = asyncio.run(main())
    sync_full = chat_create(n=2, logprobs=True)
    assert full.choices == sync_full.choices and full.usage == sync_full.usage
    sync_chunks = list(chat_create(n=2, stream=True, stream_options={"include_usage": True}))
    strip = lambda cs: [c.model_dump(exclude={"id", "created"}) for c in cs]  # noqa: E731
    assert strip(chunks) == strip(sync_chunks)


def test_async_completions_run_prompts_concurrently():
    backend = AsyncFakeBackend()

    async def main():
        stream = await AsyncCompletions(backend).create(prompt=[[5, 6], [7, 8, 9]], stream=True)
        return [c async for c in stream]

    indexes = [c.choices[0].index for c in asyncio.run(main())]
    assert sorted(set(indexes)) == [0, 1]
    assert indexes != sorted(indexes)  # interleaved, not one prompt after the other
    full = asyncio.run(AsyncCompletions(AsyncFakeBackend()).create(prompt=[[5, 6], [7, 8, 9]]))
    assert full.choices == completion_create(prompt=[[5, 6], [7, 8, 9]]).choices


def test_async_early_exit_aborts_every_prompt():
    backend = AsyncFakeBackend()

    async def main():
        stream = await AsyncCompletions(backend).create(prompt=[[5, 6], [7, 8, 9]], stream=True)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(main())
    assert sorted(backend.aborted) == sorted(request_id for request_id, _, _ in backend.calls)


def test_async_errors_propagate():
    backend = AsyncFakeBackend(lambda *a: scripted(*a, finish="abort"))
    with pytest.raises(RequestAborted):
        asyncio.run(AsyncChat(backend).completions.create(messages=MESSAGES))
    with pytest.raises(InvalidRequestError):
        asyncio.run(AsyncChat(backend).completions.create(messages=[]))


# ---------------------------------------------------------------------------------------------
# Token spelling


def test_token_text_spells_partial_characters_as_bytes():
    assert token_text("é".encode()) == "é"
    assert token_text("é".encode()[:1]) == "bytes:\\xc3"


def test_hf_token_bytes_byte_level_bpe():
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"])
    rust.train_from_iterator(["hello world, héllo wörld 日本"] * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust)
    token_bytes = hf_token_bytes(hf)
    text = "hello wörld 日本 hé"
    ids = hf.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(t) for t in ids) == text.encode()
    assert token_bytes(hf.convert_tokens_to_ids("<|end|>")) == b"<|end|>"


def test_hf_token_bytes_sentencepiece_spelling():
    class SentencePieceLike:
        pieces = {0: "▁a", 1: "<0xE6>", 2: "▁hello", 3: "<s>"}

        def convert_ids_to_tokens(self, ids):
            return self.pieces[ids] if isinstance(ids, int) else [self.pieces[i] for i in ids]

        def encode(self, text, add_special_tokens):
            return [0]

        def get_added_vocab(self):
            return {"<s>": 3}

    token_bytes = hf_token_bytes(SentencePieceLike())
    assert [token_bytes(t) for t in range(4)] == [b" a", b"\xe6", b" hello", b"<s>"]

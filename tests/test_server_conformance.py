"""What the peers' own server test suites (llama.cpp's, vLLM's OpenAI entrypoints) found broken in
``lmserve serve``, each driven through the official ``openai`` client (plain HTTP where the
client cannot express the request): tool results with a name, the chosen token in text
completion logprobs, /tokenize's add_special_tokens for chats, the role and the finish reason
in chunks of their own, n past the batch, OpenAI's error details, and structured output on an
install without xgrammar."""

from __future__ import annotations

import json
import shutil
import sys

import openai
import pytest

from lmserve.cli import main as lmserve_main
from server_process import ServerProcess, wait_until_idle

MODEL = "tiny"
CONTEXT = 1024
BATCH = 4  # local mode's batch
DECORATION = 0  # the token the test tokenizer puts before a text (<|endoftext|>), as Llama 3's puts its BOS
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
LONG = {"ignore_eos": True}  # the random model may pick eos at any point; these tests want lengths
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with a tokenizer that decorates a text with a leading special token."""
    path = tmp_path_factory.mktemp("decorated") / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [DECORATION],
                                             "tokens": ["<|endoftext|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with ServerProcess(["--model", model_dir, "--served-model-name", MODEL, "--max-num-sequence", str(BATCH),
                        "--max-single-sequence-length", str(CONTEXT)], log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with server.openai_client() as c:
        yield c


def test_a_tool_result_may_name_its_function(client, server):
    """OpenAI's cookbook sends the function's name with a tool result; an agent must be able to
    go on after its first call."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    named = [*history[:-1], {**history[-1], "name": "get_weather"}]
    reply = client.chat.completions.create(model=MODEL, messages=named, tools=[WEATHER], max_tokens=3,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens == len(server.tokenize(messages=named, tools=[WEATHER]))
    assert server.tokenize(messages=named) == server.tokenize(messages=history)


@pytest.mark.parametrize("top", [0, 2])
def test_text_completion_logprobs_hold_the_chosen_token(client, top):
    """OpenAI always returns the sampled token's logprob among the top ones: ``logprobs + 1``
    entries at most, the chosen one alone with ``logprobs: 0``."""
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, logprobs=top,
                                      temperature=1.0, seed=7, extra_body=LONG)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 8
    for token, logprob, alternatives in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert alternatives[token] == logprob
        assert max(top, 1) <= len(alternatives) <= top + 1


def test_tokenize_a_chat_with_add_special_tokens(client, server):
    """vLLM's /tokenize takes add_special_tokens with messages: the tokenizer's decoration on top
    of the template's, which the chat endpoint does not add."""
    plain = server.tokenize(messages=MESSAGES)
    assert server.tokenize(messages=MESSAGES, add_special_tokens=False) == plain
    assert server.tokenize(messages=MESSAGES, add_special_tokens=True) == [DECORATION, *plain]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == len(plain)
    # A text prompt gets it by default, as /v1/completions tokenizes it.
    assert server.tokenize(prompt="hi") == [DECORATION, *server.tokenize(prompt="hi", add_special_tokens=False)]


def test_streams_send_the_role_first_and_the_finish_reason_last_each_alone(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, extra_body=LONG))
    first, last = chunks[0].choices[0], chunks[-1].choices[0]
    assert first.delta.model_dump(exclude_none=True) == {"role": "assistant", "content": ""}
    assert first.finish_reason is None
    assert last.delta.model_dump(exclude_none=True) == {} and last.finish_reason == "length"
    middle = [c.choices[0] for c in chunks[1:-1]]
    assert all(c.delta.content and c.delta.role is None and c.finish_reason is None for c in middle)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=LONG)
    assert "".join(c.delta.content for c in middle) == whole.choices[0].message.content

    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                            stream=True, extra_body=LONG))
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1].choices[0].text == "" and all(c.choices[0].text for c in chunks[:-1])


def test_n_past_the_batch_is_queued(client, server):
    """OpenAI and vLLM take up to 128 choices; those past the batch wait in the engine's queue."""
    n = 3 * BATCH + 1
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=n, max_tokens=3, extra_body=LONG)
    assert sorted(c.index for c in reply.choices) == list(range(n))
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 3 * n
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], n=BATCH, max_tokens=2, stream=True,
                                            extra_body=LONG))
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == list(range(2 * BATCH))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=129, max_tokens=1)
    assert info.value.param == "n"
    wait_until_idle(server.base_url)  # and every page given back


def test_errors_carry_openai_details(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * CONTEXT, max_tokens=4)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CONTEXT)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, logit_bias={"999999": 5})
    assert info.value.param == "logit_bias" and "999999" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, response_format={
            "type": "json_schema", "json_schema": {"schema": {"type": "object"}}})
    assert info.value.param == "response_format"
    assert "response_format.json_schema.name: Field required" in info.value.message
    # An empty model name means the one served, as vLLM reads it.
    assert client.chat.completions.create(model="", messages=MESSAGES, max_tokens=1).model == MODEL
    assert client.completions.create(model="", prompt="hi", max_tokens=1).model == MODEL


# -- an install without xgrammar (``pip install lmserve``, no extra) ----------------------------------

@pytest.fixture(scope="module")
def plain_install_server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("plain") / "server.log")
    with ServerProcess(["--model", model_dir, "--served-model-name", MODEL], log,
                       hide_modules=["xgrammar"]) as proc:
        yield proc


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}),
     "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "[0-9]+"}}), "structured_outputs"),
    (dict(tools=[WEATHER], tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
])
def test_without_xgrammar_constrained_requests_get_a_400_naming_the_extra(plain_install_server, kwargs, param):
    with plain_install_server.openai_client() as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
        assert (info.value.param, info.value.code) == (param, "structured_output_unavailable")
        assert "lmserve[structured]" in info.value.message
        # The server goes on serving everyone else.
        assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices


def test_without_xgrammar_the_rest_works_and_the_server_says_so_once(plain_install_server):
    with plain_install_server.openai_client() as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert info.value.code == "structured_output_unavailable"
        # Tool calls the model may choose to make are read from its free text.
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert plain_install_server.log().count("structured output is off: xgrammar is not installed") == 1


@pytest.mark.parametrize("installed", [True, False])
def test_plan_says_whether_structured_output_works(tiny_model_dir, monkeypatch, capsys, installed):
    if not installed:
        monkeypatch.setitem(sys.modules, "xgrammar", None)
    assert lmserve_main(["plan", "--model", tiny_model_dir]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("structured_output"))
    if installed:
        assert "off" not in line and "xgrammar" in line
    else:
        assert "off: xgrammar is not installed" in line and "lmserve[structured]" in line

"""OpenAI request models: parsing, their mapping to SamplingParams, and errors that name the field."""

from __future__ import annotations

import pytest

from lmserve.errors import InvalidRequestError
from lmserve.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.parse({"messages": MESSAGES, **fields})


def chat_params(default_max_tokens=100, **fields):
    return chat(**fields).to_sampling_params(default_max_tokens)


def completion_params(default_max_tokens=100, **fields):
    return CompletionRequest.parse({"prompt": "hi", **fields}).to_sampling_params(default_max_tokens)


def param_of(call, *args, **kwargs) -> str:
    with pytest.raises(InvalidRequestError) as info:
        call(*args, **kwargs)
    return info.value.param


def test_openai_defaults():
    p = chat_params()
    assert (p.n, p.temperature, p.top_p, p.max_tokens) == (1, 1.0, 1.0, 100)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs, p.stop) == (0.0, 0.0, None, [])


def test_explicit_null_means_default():
    p = chat_params(temperature=None, n=None, top_p=None, stop=None, max_tokens=None)
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.stop) == (1, 1.0, 1.0, 100, [])


def test_fields_reach_sampling_params():
    p = chat_params(n=3, temperature=0.0, top_p=0.5, stop="###", seed=7, presence_penalty=0.5,
                    frequency_penalty=-0.5, logit_bias={"42": 5, "7": -100}, max_tokens=10)
    assert (p.n, p.temperature, p.top_p, p.stop, p.seed, p.max_tokens) == (3, 0.0, 0.5, ["###"], 7, 10)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.logit_bias == {42: 5.0, 7: -100.0}


def test_extensions_reach_sampling_params():
    p = chat_params(top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, stop_token_ids=[3, 4],
                    min_tokens=2, skip_special_tokens=False, include_stop_str_in_output=True)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos) == (5, 0.1, 1.2, True)
    assert (p.stop_token_ids, p.min_tokens, p.skip_special_tokens, p.include_stop_str_in_output) == (
        [3, 4], 2, False, True)


def test_no_default_max_tokens_leaves_sampling_params_default():
    assert chat_params(default_max_tokens=None).max_tokens is None


def test_max_completion_tokens_is_max_tokens():
    assert chat_params(max_completion_tokens=7).max_tokens == 7
    assert chat(max_completion_tokens=7).max_tokens_param == "max_completion_tokens"
    assert param_of(chat_params, max_completion_tokens=7, max_tokens=7) == "max_tokens"


def test_chat_logprobs():
    assert chat_params(logprobs=True).logprobs == 0
    assert chat_params(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat_params(logprobs=False).logprobs is None
    assert param_of(chat_params, top_logprobs=2) == "top_logprobs"
    assert param_of(chat_params, logprobs=False, top_logprobs=2) == "top_logprobs"
    assert param_of(chat, logprobs=True, top_logprobs=21) == "top_logprobs"


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 129), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("max_tokens", 0), ("max_completion_tokens", 0),
    ("min_p", 1.5), ("repetition_penalty", 0), ("min_tokens", -1), ("top_k", -2), ("seed", 2**64),
    ("stop", ""), ("stop", ["a", ""]), ("stop", ["s"] * 17), ("stop_token_ids", [-1]),
    ("stream", "yes please"), ("user", 5),
])
def test_out_of_range_values_name_the_field(field, value):
    assert param_of(chat, **{field: value}) == field


def test_logit_bias_errors_name_the_field():
    assert param_of(chat, logit_bias={"x": 1}) == "logit_bias"
    assert param_of(chat, logit_bias={"5": 101}) == "logit_bias"


def test_unknown_fields_are_refused_by_name():
    with pytest.raises(InvalidRequestError) as info:
        chat(max_token=5)
    assert info.value.param == "max_token"
    assert "max_token: unknown field" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "hi", "colour": "red"}]})
    assert info.value.param == "messages"
    assert "messages.0.colour: unknown field" in str(info.value)  # the path in the request


def test_messages_shapes():
    request = ChatCompletionRequest.parse({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "call it", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]})
    assert [m.role for m in request.messages] == ["developer", "system", "user", "assistant", "tool"]
    assert param_of(ChatCompletionRequest.parse, {"messages": []}) == "messages"
    assert param_of(ChatCompletionRequest.parse, {}) == "messages"
    robot = {"role": "robot", "content": "x"}
    assert param_of(ChatCompletionRequest.parse, {"messages": [robot]}) == "messages"
    # Only text content parts: an image part is refused, naming where it is.
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
    where = r"messages\.0\.content\.0\.type: Input should be 'text'"
    with pytest.raises(InvalidRequestError, match=where):
        ChatCompletionRequest.parse({"messages": [image]})


def test_response_format_tools_and_tool_choice_shapes():
    chat(response_format={"type": "json_object"})
    schema = {"name": "x", "schema": {"type": "object"}}
    fmt = chat(response_format={"type": "json_schema", "json_schema": schema})
    assert fmt.response_format.json_schema.json_schema == {"type": "object"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat(tools=tools, tool_choice="auto")
    chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert param_of(chat, response_format={"type": "xml"}) == "response_format"
    assert param_of(chat, tools=[{"type": "function", "function": {}}]) == "tools"
    assert param_of(chat, tool_choice="sometimes") == "tool_choice"


def test_stream_options_need_stream():
    assert chat(stream=True, stream_options={"include_usage": True}).wants_usage_chunk
    assert not chat(stream=True).wants_usage_chunk
    assert param_of(chat_params, stream_options={"include_usage": True}) == "stream_options"


def test_min_tokens_must_fit_max_tokens():
    assert param_of(chat_params, min_tokens=20, max_tokens=10) == "min_tokens"
    assert param_of(chat_params, default_max_tokens=5, min_tokens=6) == "min_tokens"


@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, prompts):
    assert CompletionRequest.parse({"prompt": prompt}).prompts() == prompts


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], [-1], None, [1, "a"]])
def test_bad_completion_prompts_are_refused(prompt):
    assert param_of(CompletionRequest.parse, {"prompt": prompt}) == "prompt"


def test_completion_fields():
    assert completion_params(logprobs=3).logprobs == 3
    assert completion_params().logprobs is None
    assert param_of(completion_params, logprobs=21) == "logprobs"
    assert param_of(completion_params, suffix="x") == "suffix"
    assert completion_params(echo=True, logprobs=2).prompt_logprobs == 2
    assert completion_params(logprobs=2).prompt_logprobs is None
    assert completion_params(echo=True, max_tokens=0).max_tokens == 0
    assert param_of(completion_params, max_tokens=-1) == "max_tokens"
    assert param_of(completion_params, top_logprobs=1) == "top_logprobs"  # a chat field
    assert completion_params(echo=True, n=2, max_tokens=3).n == 2


def test_tool_choice_becomes_a_tool_mode():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat(tools=tools).tool_mode() == ("auto", None)
    assert chat(tools=tools, tool_choice="required").tool_mode() == ("required", None)
    assert chat(tools=tools, tool_choice="none").tool_mode() is None
    named = {"type": "function", "function": {"name": "f"}}
    assert chat(tools=tools, tool_choice=named).tool_mode() == ("function", "f")
    assert chat().tool_mode() is None
    assert param_of(chat_params, tool_choice="auto") == "tool_choice"  # no tools
    assert chat_params(tools=tools, parallel_tool_calls=False).n == 1


def test_response_format_and_structured_outputs_become_one_constraint():
    assert chat_params(response_format={"type": "text"}).structured_outputs is None
    obj = chat_params(response_format={"type": "json_object"}).structured_outputs
    assert obj.kind == "json_object" and obj.origin == "response_format"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat_params(response_format=fmt).structured_outputs.json == schema
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert chat_params(response_format=no_schema).structured_outputs.kind == "json_object"
    for so, kind in [({"json": schema}, "json"), ({"regex": "a+"}, "regex"), ({"choice": ["a", "b"]}, "choice"),
                     ({"grammar": "root ::= \"a\""}, "grammar"), ({"json_object": True}, "json_object"),
                     ({"structural_tag": {"type": "structural_tag"}}, "structural_tag")]:
        params = completion_params(structured_outputs=so)
        assert params.structured_outputs.kind == kind and params.structured_outputs.origin == "structured_outputs"
    assert chat_params(structured_outputs={"regex": "a", "disable_any_whitespace": False}
                       ).structured_outputs.compact is False
    assert param_of(completion_params, structured_outputs={"regex": "a", "choice": ["b"]}) == "structured_outputs"
    assert param_of(completion_params, structured_outputs={}) == "structured_outputs"
    assert param_of(completion_params, structured_outputs={"guided_json": {}}) == "structured_outputs"
    assert param_of(chat_params, response_format=fmt, structured_outputs={"regex": "a"}) == "structured_outputs"
    assert param_of(chat_params, response_format=fmt, min_tokens=1) is None  # SamplingParams' own refusal

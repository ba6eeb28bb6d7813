"""Tool calling: each family's calls read from streamed text (whatever the split), the grammar that
forces valid calls, the prompt and history, OpenAI-shaped responses and stream pieces, and the
official ``openai`` client against ``lmserve serve`` on the built-in model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import xgrammar as xgr

from lmserve.errors import InvalidRequestError
from lmserve.frontend.openai.facades import Chat
from lmserve.frontend.openai.protocol import ChatCompletionRequest
from lmserve.frontend.tools.formats import TOOL_FORMATS, format_for_template
from lmserve.frontend.tools.parser import ToolCallStream
from lmserve.frontend.tools.prompt import tool_messages
from lmserve.outputs import RequestOutput, SequenceDelta
from test_openai_api import FakeBackend, as_openai
from test_structured_server import MODEL

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}
ADD = {"name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, ADD)]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, ADD)}

CALLS = [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
         {"name": "add", "arguments": '{"a": 2, "b": 3}'}]


# -- reading calls out of streamed text ---------------------------------------------------------

def run_stream(fmt, pieces: list[str]):
    stream = ToolCallStream(fmt)
    content, calls = "", {}
    for i, text in enumerate(pieces):
        out, call_pieces = stream.feed(text, final=i == len(pieces) - 1)
        content += out
        for p in call_pieces:
            call = calls.setdefault(p.index, {"id": p.id, "name": p.name, "arguments": ""})
            call["arguments"] += p.arguments
    return content, [{"name": c["name"], "arguments": c["arguments"]} for _, c in sorted(calls.items())]


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_calls_are_read_whatever_the_text_is_split_into(name):
    fmt = TOOL_FORMATS[name]
    calls = CALLS[:1] if fmt.whole_answer else CALLS
    prefix = "" if fmt.whole_answer else "Let me check. "
    text = prefix + fmt.render_calls(calls)
    want = (prefix, calls)
    assert run_stream(fmt, [text]) == want
    assert run_stream(fmt, list(text)) == want  # one character at a time
    for cut in range(1, len(text)):
        assert run_stream(fmt, [text[:cut], text[cut:]]) == want, cut


def test_text_that_only_looks_like_a_tag_is_content():
    fmt = TOOL_FORMATS["hermes"]
    assert run_stream(fmt, ["a <tool", "_ca", "ll is not here <tool"]) == ("a <tool_call is not here <tool", [])
    assert run_stream(fmt, ["x <tool_call>{not json</tool_call> y"]) == ("x <tool_call>{not json</tool_call> y", [])
    # An answer cut inside a call (max_tokens) keeps its text as content.
    assert run_stream(fmt, ['<tool_call>{"name": "add", "argu']) == ('<tool_call>{"name": "add", "argu', [])
    assert run_stream(TOOL_FORMATS["smollm2"], ["<tool_call>[]</tool_call>"]) == ("", [])
    assert run_stream(TOOL_FORMATS["llama3_json"], ["  Hello {x}"]) == ("  Hello {x}", [])


def test_tags_and_separators_inside_json_strings_stay_in_the_call():
    tricky = [{"name": "add", "arguments": '{"note": "a </tool_call> b; c"}'}]
    for name in ("hermes", "smollm2", "llama3_json"):
        fmt = TOOL_FORMATS[name]
        text = fmt.render_calls(tricky)
        assert run_stream(fmt, [text]) == ("", tricky), name
        assert run_stream(fmt, list(text)) == ("", tricky), name


def test_the_template_tells_the_format():
    assert format_for_template("... <tool_call> ...", True).name == "hermes"
    assert format_for_template("... <|python_tag|> ...", True).name == "llama3_json"
    assert format_for_template("... <tool_call> ...", False).name == "smollm2"
    assert format_for_template(None, False).name == "smollm2"


# -- the grammar that forces valid calls ---------------------------------------------------------

@pytest.fixture(scope="module")
def compiler(builtin_engine):
    return builtin_engine._core.grammars._get_compiler()


def accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_required_calls_must_name_a_tool_with_valid_arguments(compiler, name):
    fmt = TOOL_FORMATS[name]
    functions = [WEATHER, ADD]
    required = compiler.compile_structural_tag(json.dumps(fmt.structural_tag(functions, True, True)))
    assert accepts(required, fmt.render_calls(CALLS[:1]))
    assert not accepts(required, "Sure! " + fmt.render_calls(CALLS[:1]))  # calls only
    bad_name = fmt.render_calls([{"name": "delete_all", "arguments": "{}"}])
    bad_args = fmt.render_calls([{"name": "add", "arguments": '{"a": "two", "b": 3}'}])
    missing = fmt.render_calls([{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    assert not any(accepts(required, t) for t in (bad_name, bad_args, missing))
    auto = fmt.structural_tag(functions, False, True)
    if auto is not None:  # free text, and a valid call once the model opens one
        auto = compiler.compile_structural_tag(json.dumps(auto))
        assert accepts(auto, "No tool is needed.")
        assert accepts(auto, "Let me look. " + fmt.render_calls(CALLS[:1]))
        assert not accepts(auto, "Let me look. " + bad_args)
        if not fmt.one_call_per_block:  # the family's "no call needed" is allowed in auto only
            assert accepts(auto, "<tool_call>[]</tool_call>")
            assert not accepts(required, "<tool_call>[]</tool_call>")


def test_one_call_unless_parallel(compiler):
    fmt = TOOL_FORMATS["hermes"]
    single = compiler.compile_structural_tag(json.dumps(fmt.structural_tag([WEATHER, ADD], True, False)))
    assert accepts(single, fmt.render_calls(CALLS[:1]))
    assert not accepts(single, fmt.render_calls(CALLS))
    smol = TOOL_FORMATS["smollm2"]
    single = compiler.compile_structural_tag(json.dumps(smol.structural_tag([WEATHER, ADD], True, False)))
    assert not accepts(single, smol.render_calls(CALLS).replace("\n", ""))


# -- the prompt -----------------------------------------------------------------------------------

def test_a_template_without_tools_gets_the_family_prompt_and_flattened_history():
    fmt = TOOL_FORMATS["smollm2"]
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": CALLS[0]}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, tools = tool_messages(history, TOOLS, fmt, template_renders_tools=False, show_tool_prompt=True)
    assert tools is None
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert '"name": "get_weather"' in messages[0]["content"] and messages[0]["content"].endswith("Be brief.")
    assert messages[2] == {"role": "assistant", "content": fmt.render_calls([CALLS[0]])}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    plain, _ = tool_messages(history[1:2], TOOLS, fmt, template_renders_tools=False, show_tool_prompt=False)
    assert plain == history[1:2]  # tool_choice "none": no tool prompt


def test_a_template_with_tools_gets_them_and_argument_objects():
    history = [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": CALLS[1]}]}]
    messages, tools = tool_messages(history, TOOLS, TOOL_FORMATS["hermes"], template_renders_tools=True,
                                    show_tool_prompt=True)
    assert tools == TOOLS and messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}


def test_a_template_with_an_unknown_call_format_refuses_tool_calls():
    backend = FakeBackend(scripted_call)
    backend.tokenizer.chat_template = "[TOOL_CALLS] ..."  # renders tools, in a format lmserve cannot read
    with pytest.raises(InvalidRequestError, match="cannot read") as err:
        Chat(backend).completions.create(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    assert err.value.param == "tool_choice"
    Chat(backend).completions.create(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")


def test_tool_requests_are_checked():
    def bad(**body):
        with pytest.raises(InvalidRequestError) as err:
            ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "x"}], **body}
                                        ).to_sampling_params(10)
        return err.value.param

    assert bad(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}) == "tool_choice"
    assert bad(tools=TOOLS + TOOLS[:1]) == "tools"
    assert bad(tools=TOOLS, response_format={"type": "json_object"}) == "tool_choice"
    assert bad(tool_choice="required") == "tool_choice"
    request = ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    assert request.tool_mode() == ("auto", None)


# -- responses and stream pieces (a scripted model) -----------------------------------------------

def scripted_call(request_id, prompt_ids, params, text=None):
    text = text or "Checking. " + TOOL_FORMATS["hermes"].render_calls(CALLS)
    outputs = []
    for i in range(0, len(text), 3):
        last = i + 3 >= len(text)
        delta = SequenceDelta(0, text[i:i + 3], [ord(c) for c in text[i:i + 3]], None, "stop" if last else None)
        outputs.append(RequestOutput(request_id, prompt_ids, [delta], finished=last))
    return outputs


def test_tool_calls_come_back_as_openai_shapes_and_stream_pieces_fold_into_them():
    import openai.types.chat as types

    chat = Chat(FakeBackend(scripted_call))
    whole = chat.completions.create(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    choice = as_openai(whole, types.ChatCompletion).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(c["name"], json.dumps(json.loads(c["arguments"]))) for c in CALLS]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    chunks = list(chat.completions.create(messages=[{"role": "user", "content": "x"}], tools=TOOLS, stream=True))
    calls: dict = {}
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"name": piece.function.name, "arguments": ""})
            call["arguments"] += piece.function.arguments
    assert [calls[i] for i in sorted(calls)] == [c.function.model_dump() for c in choice.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools the same text is content.
    plain = chat.completions.create(messages=[{"role": "user", "content": "x"}]).choices[0]
    assert plain.message.tool_calls is None and "<tool_call>" in plain.message.content


# -- the built-in model over HTTP ----------------------------------------------------------------

QUESTIONS = ["What is the weather like in Paris today?", "Is it cold in Oslo?", "What is 2 plus 3?",
             "Add 40 and 2.", "Weather in Tokyo, in fahrenheit please.", "How much is 7 + 8?",
             "Should I take an umbrella in London?", "Sum 100 and 250.", "Is it sunny in Madrid?",
             "What is 12 plus 30?"]


def valid(call) -> bool:
    try:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    except (KeyError, json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_required_and_named_tool_choice_always_give_valid_calls(builtin_client):
    def ask(job):
        question, choice = job
        return builtin_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice,
            temperature=0, max_tokens=120).choices[0]

    named = {"type": "function", "function": {"name": "add"}}
    jobs = [(q, "required") for q in QUESTIONS] + [(q, named) for q in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    for (question, choice), answer in zip(jobs, answers):
        assert answer.finish_reason == "tool_calls", (question, answer)
        assert answer.message.tool_calls and all(valid(c) for c in answer.message.tool_calls), answer
        if choice is named:
            assert [c.function.name for c in answer.message.tool_calls] == ["add"]
    # The model picks the fitting tool when it must call one (greedy; 10 of 10 when written).
    picked = [a.message.tool_calls[0].function.name for a in answers[:len(QUESTIONS)]]
    assert sum(p == ("add" if any(w in q for w in ("plus", "Add", "Sum", "+")) else "get_weather")
               for p, q in zip(picked, QUESTIONS)) >= 8


def test_streamed_tool_calls_reassemble_into_the_whole_answer(builtin_client):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
                tool_choice="required", temperature=0, max_tokens=120)
    whole = builtin_client.chat.completions.create(**body).choices[0]
    calls: dict = {}
    finish = None
    for chunk in builtin_client.chat.completions.create(**body, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"name": piece.function.name, "arguments": ""})
            call["arguments"] += piece.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert [calls[i] for i in sorted(calls)] == [c.function.model_dump() for c in whole.message.tool_calls]
    assert finish == whole.finish_reason == "tool_calls"


def test_a_tool_result_turn_is_answered(builtin_client):
    first = builtin_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice="required", temperature=0, max_tokens=120).choices[0]
    call = first.message.tool_calls[0]
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    answer = builtin_client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=60).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content.strip()
    assert answer.message.tool_calls is None


def test_a_tool_schema_that_cannot_be_enforced_is_a_400(builtin_client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "null"}}}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        builtin_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                               tools=tools, tool_choice="required", max_tokens=5)
    assert err.value.body["param"] == "tools" and "/properties/x/not" in err.value.body["message"]


def test_tokenize_renders_tools_as_the_chat_does(builtin_server, builtin_client):
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    chat = builtin_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1)
    counted = httpx.post(builtin_server.base_url + "/tokenize",
                         json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()["count"]
    plain = httpx.post(builtin_server.base_url + "/tokenize",
                       json={"model": MODEL, "messages": messages}).json()["count"]
    assert counted == chat.usage.prompt_tokens > plain + 100  # lmserve's tool prompt is in both

"""Tools and tool-call history in the prompt.

When the model's chat template renders tools (Qwen, Hermes, Llama 3.1 and most newer models),
the template gets them, and the history's call arguments as objects (what templates index).
When it does not (the built-in SmolLM2's template has no tools), lmserve writes the tool prompt
of the model's family into the system message, and the history's calls and results as the model
reads them: calls in the family's format in the assistant's turn, results as ``tool`` turns.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from lmserve.frontend.tools.formats import ToolFormat, loads_or_text

# The tool prompt SmolLM2 was trained with, in substance: the tools in <tools>, the calls as one
# JSON list in <tool_call>, an empty list when no call is needed.
_TOOL_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, point it out and refuse to answer.
If the given question lacks the parameters required by the function, also point it out.
You have access to the following tools:
<tools>{tools}</tools>
The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no function call is needed, please make the tool calls an empty list '[]'.
{example}"""


def tool_prompt(fmt: ToolFormat, tools: list[dict[str, Any]]) -> str:
    """The system prompt that shows ``tools`` (OpenAI function definitions) to a model of
    ``fmt``'s family whose template cannot."""
    example = fmt.render_calls([{"name": "func_name1",
                                 "arguments": '{"argument1": "value1", "argument2": "value2"}'}])
    return _TOOL_PROMPT.format(tools=json.dumps(tools, ensure_ascii=False), example=example)


def tool_messages(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                  fmt: ToolFormat, template_renders_tools: bool, show_tool_prompt: bool
                  ) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """The messages and tools to hand the chat template.

    ``messages`` are OpenAI messages as plain dicts; ``tools`` OpenAI tool definitions
    (``{"type": "function", "function": {...}}``). ``show_tool_prompt``: write lmserve's tool
    prompt when the template cannot show the tools (not for ``tool_choice: "none"``).
    """
    if template_renders_tools:
        return [_with_argument_objects(m) for m in messages], tools
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            calls = [c["function"] for c in m.pop("tool_calls", None) or []]
            text = m.get("content") or ""
            if calls:
                text = (text + "\n" if text else "") + fmt.render_calls(calls)
            m["content"] = text
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and show_tool_prompt:
        prompt = tool_prompt(fmt, [t["function"] for t in tools])
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": prompt + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Assistant tool calls with their JSON arguments parsed (templates index them as objects)."""
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"], "arguments": loads_or_text(call["function"]["arguments"])}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}

"""How a model family writes tool calls: the text format, its parser, and the grammar that forces
it (a registry, so more families can be added).

A ``ToolFormat`` knows, for its family: where calls start and end in the output (``begin`` /
``end`` tags around a block), how to read the calls in a block, how to write calls back into a
conversation's history, and the xgrammar structural tag that makes the model write valid calls
(``tool_choice`` ``required`` or a named function: calls only; ``auto``: free text, and once the
model opens a call block, a valid one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ParsedCall:
    """One tool call read from the model's output; ``arguments`` is JSON text."""

    name: str
    arguments: str


def _arguments_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    """A structural tag's JSON content. At most one whitespace character between tokens: free
    whitespace lets a small model pad a call with newlines until max_tokens cuts it."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` (an OpenAI ``function`` definition)."""
    params = tool.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, arguments_key: params},
            "required": ["name", arguments_key]}


class ToolFormat:
    """A family's tool-call text format. Subclasses set the tags and the block's JSON shape."""

    name: str
    begin: str  # opens a block of calls in the output
    end: str  # closes it
    # The tags as the grammar writes them, when the family's trained layout adds to them (e.g.
    # newlines); grammar_begin starts with begin, which opens a block in "auto".
    grammar_begin: Optional[str] = None
    grammar_end: Optional[str] = None
    arguments_key = "arguments"
    one_call_per_block = True  # False: a block holds a JSON list of calls
    whole_answer = False  # True: no tags; an answer starting with "{" is one block

    def parse_block(self, block: str) -> Optional[list[ParsedCall]]:
        """The calls in the text between ``begin`` and ``end``; None when it is not valid."""
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        return self._calls([value] if self.one_call_per_block else value)

    def _calls(self, items: Any) -> Optional[list[ParsedCall]]:
        """Call objects (``{"name", arguments_key}``) as ParsedCalls; None if one is not a call."""
        if not isinstance(items, list):
            return None
        calls = []
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get(self.arguments_key, {}), dict)):
                return None
            calls.append(ParsedCall(item["name"], _arguments_text(item.get(self.arguments_key, {}))))
        return calls

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """Assistant tool calls (OpenAI ``{"name", "arguments"}``, arguments as JSON text) as the
        model writes them, for a conversation's history."""
        items = [{"name": c["name"], self.arguments_key: loads_or_text(c["arguments"])} for c in calls]
        begin, end = self.trained_tags
        if self.one_call_per_block:
            return "\n".join(f"{begin}{_arguments_text(i)}{end}" for i in items)
        listed = ",\n".join(_arguments_text(i) for i in items)
        return f"{begin}[\n{listed}\n]{end}"

    @property
    def trained_tags(self) -> tuple[str, str]:
        """A block's tags as the family writes them (what the grammar forces)."""
        return self.grammar_begin or self.begin, self.grammar_end or self.end

    def structural_tag(self, tools: list[dict[str, Any]], required: bool,
                       parallel: bool) -> Optional[dict[str, Any]]:
        """The xgrammar structural tag for ``tools`` (OpenAI function definitions): calls only
        when ``required``, else free text with calls once a block is opened; one call in all
        unless ``parallel``. None: the answer is left free."""
        one_call = {"anyOf": [_call_schema(t, self.arguments_key) for t in tools]}
        content: dict[str, Any]
        if self.one_call_per_block:
            content = one_call
        else:
            # An empty list is the family's "no call needed", allowed unless a call is required.
            content = {"type": "array", "items": one_call, "minItems": 1 if required else 0}
            if not parallel:
                content["maxItems"] = 1
        begin, end = self.trained_tags
        tag = {"type": "tag", "begin": begin, "end": end, "content": _json_content(content)}
        stop_after_first = not parallel or not self.one_call_per_block
        if required:
            fmt = {"type": "tags_with_separator", "tags": [tag], "separator": "\n",
                   "at_least_one": True, "stop_after_first": stop_after_first}
        else:
            fmt = {"type": "triggered_tags", "triggers": [self.begin], "tags": [tag],
                   "at_least_one": False, "stop_after_first": stop_after_first}
        return {"type": "structural_tag", "format": fmt}


def loads_or_text(arguments: Any) -> Any:
    """Call arguments as an object when they are JSON text (what templates index), else as given."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments


class SmolLM2Format(ToolFormat):
    """SmolLM2 (the built-in model): ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``."""

    name = "smollm2"
    begin, end = "<tool_call>", "</tool_call>"
    one_call_per_block = False


class HermesFormat(ToolFormat):
    """Hermes and Qwen 2.5/3: one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` per
    call, written (and forced) on lines of their own, as their templates write them."""

    name = "hermes"
    begin, end = "<tool_call>", "</tool_call>"
    grammar_begin, grammar_end = "<tool_call>\n", "\n</tool_call>"


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1-3.3 JSON calls: the whole answer is ``{"name": ..., "parameters": {...}}`` (several
    separated by ``;``). The ``<|python_tag|>`` the model may put first is a special token, left
    out of the text like every special token, so an answer is a call block when it starts with
    ``{``. Forced calls are one call (the format has no agreed way to write several)."""

    name = "llama3_json"
    begin, end = "", ""  # the whole answer, see whole_answer
    arguments_key = "parameters"
    whole_answer = True

    def parse_block(self, block: str) -> Optional[list[ParsedCall]]:
        calls: list[ParsedCall] = []
        decoder, at = json.JSONDecoder(), 0
        while True:
            while at < len(block) and (block[at].isspace() or block[at] == ";"):
                at += 1
            if at == len(block):
                return calls
            try:
                value, at = decoder.raw_decode(block, at)
            except json.JSONDecodeError:
                return None
            parsed = self._calls([value])
            if parsed is None:
                return None
            calls += parsed

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        items = [{"name": c["name"], self.arguments_key: loads_or_text(c["arguments"])} for c in calls]
        return "; ".join(_arguments_text(i) for i in items)

    def structural_tag(self, tools: list[dict[str, Any]], required: bool,
                       parallel: bool) -> Optional[dict[str, Any]]:
        if not required:
            return None  # a free answer, read as calls when it starts with "{"
        one_call = {"anyOf": [_call_schema(t, self.arguments_key) for t in tools]}
        return {"type": "structural_tag", "format": _json_content(one_call)}


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (SmolLM2Format(), HermesFormat(), Llama3JsonFormat())}


def format_for_template(template: Optional[str], renders_tools: bool) -> Optional[ToolFormat]:
    """The family format a chat template implies: Hermes/Qwen when it writes ``<tool_call>``,
    Llama 3 when it knows ``<|python_tag|>`` or ``ipython``, SmolLM2's for a template that does
    not render tools (lmserve's tool prompt then asks for that format); None for a template that
    renders tools in a format lmserve does not know."""
    text = template or ""
    if not renders_tools:
        return TOOL_FORMATS["smollm2"]
    if "<|python_tag|>" in text or "ipython" in text:
        return TOOL_FORMATS["llama3_json"]
    if "<tool_call>" in text:
        return TOOL_FORMATS["hermes"]
    return None

"""Compiling output constraints to token-level grammars with xgrammar, once per constraint.

xgrammar is imported on first use, so engines that never see a constrained request never load
it. Compiling a schema takes milliseconds to seconds; ``EngineCore.validate`` compiles in the
caller's thread (the server's request thread, never the engine loop), and xgrammar's cache makes
the second compile of the same constraint, on the engine thread, a lookup.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Iterable

from lmserve.errors import InvalidRequestError
from lmserve.structured.json_schema import SchemaError, check_schema
from lmserve.structured.params import StructuredOutputsParams
from lmserve.structured.xgrammar_lib import StructuredOutputUnavailable, import_xgrammar
from lmserve.tokenizer import Tokenizer, hf_token_bytes

# Compiled grammars kept for reuse (xgrammar's LRU cache; a JSON schema's is tens of KB).
CACHE_BYTES = 256 << 20
# xgrammar prefixes its errors with a time and a C++ source position: "[12:11:10] /x/y.cc:12: ".
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


class GrammarCompiler:
    """Turns ``StructuredOutputsParams`` into xgrammar ``CompiledGrammar`` for one tokenizer.

    Safe from several threads at once. The token table is built on the first call (a fraction of
    a second for a 50k vocabulary).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # rows of the model's logits, which may exceed the tokenizer's
        self._lock = threading.Lock()
        self._compiler: Any = None

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached). Raises ``InvalidRequestError`` naming the
        request field when the constraint is invalid or cannot be enforced, and its subclass
        ``StructuredOutputUnavailable`` when xgrammar cannot be imported."""
        origin = params.origin
        try:
            compiler = self._get_compiler()
            xgr = import_xgrammar()
        except ImportError as err:
            raise StructuredOutputUnavailable(origin, str(err.__cause__ or err)) from None
        try:
            kind = params.kind
            if kind == "json":
                schema = params.schema()
                check_schema(schema)
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=not params.compact)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    any_whitespace=not params.compact)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                assert params.choice is not None  # the field its kind names is set
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if kind == "grammar":
                grammar = params.grammar
                assert grammar is not None  # the field its kind names is set
                if "::=" not in grammar:  # no EBNF rule: Lark, as vLLM also accepts
                    grammar = xgr.Grammar.from_lark(grammar)
                return compiler.compile_grammar(grammar)
            assert params.structural_tag is not None  # the kind left: structural_tag
            tag = _current_tag_shape(json.loads(params.structural_tag))
            for where, schema in _tag_schemas(tag, ""):
                try:
                    check_schema(schema)
                except SchemaError as err:
                    raise InvalidRequestError(f"{origin}: the JSON schema at {where}/json_schema, at "
                                              f"{err}", origin) from None
            return compiler.compile_structural_tag(json.dumps(tag))
        except SchemaError as err:
            raise InvalidRequestError(f"{origin}: the JSON schema at {err}", origin) from None
        except (RuntimeError, ValueError, TypeError) as err:  # xgrammar's parse and compile errors
            message = _XGR_PREFIX.sub("", str(err)).strip()
            raise InvalidRequestError(f"{origin}: invalid {params.kind}: {message}", origin) from None

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo(_token_table(self._tokenizer, self.vocab_size),
                                         xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=self._tokenizer.eos_token_ids)
                # xgrammar's default of 8 threads only oversubscribes a small machine.
                self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)),
                                                     cache_limit_bytes=CACHE_BYTES)
            return self._compiler


def _current_tag_shape(tag: Any) -> Any:
    """A structural tag in xgrammar's current shape. vLLM's clients may still send the first one,
    ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``:
    free text, and a tag's JSON once its trigger appears, which is ``triggered_tags`` now."""
    if not (isinstance(tag, dict) and "structures" in tag and "format" not in tag):
        return tag
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise ValueError("structures must be a list of {begin, schema, end} objects")
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers,
        "tags": [{"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                  "content": {"type": "json_schema", "json_schema": s.get("schema")}}
                 for s in structures]}}


def _tag_schemas(node: Any, pointer: str) -> list[tuple[str, Any]]:
    """The JSON schemas inside a structural tag, each with its JSON pointer in the tag."""
    found: list[tuple[str, Any]] = []
    items: Iterable[tuple[Any, Any]]
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            found.append((pointer, node["json_schema"]))
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return found
    for key, child in items:
        if key != "json_schema":
            found += _tag_schemas(child, f"{pointer}/{key}")
    return found


def _token_table(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes; empty for special tokens and ids past the tokenizer's, which
    xgrammar then never allows (only the stop tokens, given apart, end the output).

    xgrammar's own ``from_huggingface`` reads chat markers such as ``<|im_start|>`` as text, so a
    JSON string could hold one; special tokens never stand for text in an output."""
    hf = tokenizer.hf
    token_bytes = hf_token_bytes(hf)
    special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    known = len(hf)
    return [b"" if i in special or i >= known else token_bytes(i) for i in range(vocab_size)]

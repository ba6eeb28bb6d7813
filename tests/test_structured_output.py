"""Structured output on the engine: every constraint kind is followed, what the grammar cannot
enforce is refused with the schema's JSON pointer, constrained rows leave the others alone, and
speculative decoding keeps constrained output identical.

The reference for "follows the constraint" is a plain check written here (``json.loads`` plus
``jsonschema`` semantics for the schemas used, ``re.fullmatch``); the reference for identity is
the same request without company, or without speculation.
"""

from __future__ import annotations

import json
import re
import threading

import pytest

from conftest import generate_tokens, run_concurrently, wait_idle
from lmserve import Engine
from lmserve.errors import InvalidRequestError
from lmserve.sampling_params import SamplingParams
from lmserve.structured.json_schema import SchemaError, check_schema
from lmserve.structured.params import StructuredOutputsParams as Constraint
from prompts import CHAT_PROMPTS

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
}, "required": ["name", "age", "pets"]}


def chat_prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def text_of(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[str, str]:
    outs = list(engine.generate(prompt, params))
    deltas = [d for o in outs for d in o.deltas]
    return "".join(d.text for d in deltas), deltas[-1].finish_reason


def follows_person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "pets"}
            and isinstance(value["name"], str) and len(value["name"]) <= 20
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and len(value["pets"]) <= 3 and set(value["pets"]) <= {"cat", "dog", "fish"})


# -- what a schema may hold ---------------------------------------------------------------------

@pytest.mark.parametrize("schema, pointer", [
    ({"type": "array", "uniqueItems": True}, "/uniqueItems"),
    ({"properties": {"a": {"not": {"type": "null"}}}}, "/properties/a/not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "/if"),
    ({"type": "array", "contains": {"const": 1}}, "/contains"),
    ({"items": {"type": "string", "pattern": "^a", "minLength": 2}}, "/items/minLength"),
    ({"type": "string", "format": "date", "maxLength": 3}, "/maxLength"),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "/allOf"),
    ({"$defs": {"a/b": {"type": "strin"}}}, "/$defs/a~1b/type"),
    ({"type": "string", "format": "password"}, "/format"),
    ({"$ref": "http://example.com/s.json"}, "/$ref"),
    ({"anyOf": [{"type": "integer"}, {"nullable": True}]}, "/anyOf/1/nullable"),
    ({"properties": []}, "/properties"),
    ([], ""),
    # Rules xgrammar drops beside $ref, enum, const and the combinators, or in other places.
    ({"$ref": "#/$defs/a", "maxLength": 2, "$defs": {"a": {"type": "string"}}}, "/maxLength"),
    ({"type": "object", "properties": {"a": {}}, "anyOf": [{"required": ["a"]}]}, "/type"),
    ({"type": "string", "enum": ["a", 1]}, "/type"),
    ({"type": "integer", "const": "x"}, "/type"),
    ({"enum": ["a"], "maxLength": 0}, "/maxLength"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, "/required"),
    ({"type": "number", "multipleOf": 2}, "/multipleOf"),
    ({"type": "object", "unevaluatedProperties": False, "additionalProperties": True}, "/unevaluatedProperties"),
    # Malformed values: a 400 naming them, never a TypeError.
    ({"type": {"a": 1}}, "/type"),
    ({"allOf": 5}, "/allOf"),
    ({"properties": {"a": {"format": {}}}}, "/properties/a/format"),
    ({"required": "a"}, "/required"),
])
def test_keywords_the_grammar_cannot_enforce_are_refused_with_their_pointer(schema, pointer):
    with pytest.raises(SchemaError) as err:
        check_schema(schema)
    assert err.value.pointer == pointer


def test_schemas_made_of_enforced_keywords_pass():
    check_schema(PERSON)
    check_schema({"$defs": {"Pet": {"enum": ["a"], "title": "Pet", "type": "string"}},
                  "anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}], "description": "x"})
    check_schema({"allOf": [{"$ref": "#/$defs/A"}], "description": "x", "$defs": {"A": {"type": "integer",
                                                                                      "multipleOf": 3}}})
    check_schema(True)


def test_a_constraint_sets_exactly_one_kind():
    assert Constraint(regex="a+").kind == "regex"
    assert Constraint(choice=["a", "b"]).choice == ("a", "b")
    for bad in (dict(), dict(regex="a", json_object=True), dict(choice=[]), dict(choice=["a", ""]),
                dict(choice="ab"), dict(grammar=""), dict(json=3)):
        with pytest.raises(ValueError):
            Constraint(**bad)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=Constraint(regex="a+"))


# -- the engine follows every kind --------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_of_constraint_is_followed(builtin_engine, temperature):
    prompt = chat_prompt(builtin_engine, "Give the name and age of a person as a JSON object.")
    checks = [
        (Constraint(json=PERSON), lambda t: follows_person(json.loads(t))),
        (Constraint(json=json.dumps(PERSON)), lambda t: follows_person(json.loads(t))),
        (Constraint(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (Constraint(regex=r"[A-Z][a-z]{2,8} is [0-9]{1,2}\."),
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} is [0-9]{1,2}\.", t)),
        (Constraint(choice=["cat", "dog", "a fish"]), lambda t: t in ("cat", "dog", "a fish")),
        (Constraint(grammar='root ::= "[" item ("," item)? "]"\nitem ::= [0-9] [0-9]?'),
         lambda t: re.fullmatch(r"\[[0-9]{1,2}(,[0-9]{1,2})?\]", t)),
        (Constraint(grammar='start: "yes" | "no"'), lambda t: t in ("yes", "no")),  # Lark
    ]
    for constraint, follows in checks:
        params = SamplingParams(temperature=temperature, seed=7, max_tokens=120, n=2,
                                structured_outputs=constraint)
        outs = list(builtin_engine.generate(prompt, params))
        for index in range(2):
            deltas = [d for o in outs for d in o.deltas if d.index == index]
            text = "".join(d.text for d in deltas)
            if deltas[-1].finish_reason == "length":  # a sampled ramble, cut as asked
                assert temperature > 0 and sum(len(d.token_ids) for d in deltas) == 120, \
                    (constraint.kind, text)
            else:
                assert deltas[-1].finish_reason == "stop" and follows(text), (constraint.kind, text)


def test_max_tokens_cuts_a_constrained_output_with_finish_reason_length(builtin_engine):
    prompt = chat_prompt(builtin_engine, "Describe a person as JSON.")
    text, reason = text_of(builtin_engine, prompt, SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=Constraint(json=PERSON)))
    assert reason == "length" and text.startswith('{"name":')


def test_a_complete_grammar_ends_the_output_even_with_ignore_eos(builtin_engine):
    prompt = chat_prompt(builtin_engine, "Pick an animal.")
    text, reason = text_of(builtin_engine, prompt, SamplingParams(
        temperature=0, max_tokens=50, ignore_eos=True, structured_outputs=Constraint(choice=["cat", "dog"])))
    assert text in ("cat", "dog") and reason == "stop"


def test_constrained_rows_leave_unconstrained_ones_untouched(builtin_engine):
    prompts = [chat_prompt(builtin_engine, p) for p in CHAT_PROMPTS[:4]]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [generate_tokens(builtin_engine, p, plain) for p in prompts]
    constrained = SamplingParams(temperature=0, max_tokens=24, structured_outputs=Constraint(json=PERSON))
    results: list = [None] * 4

    def constrained_request(i):
        results[i] = generate_tokens(builtin_engine, prompts[i], constrained)

    threads = [threading.Thread(target=constrained_request, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert run_concurrently(builtin_engine, prompts, plain) == alone
    for t in threads:
        t.join(120)
    for tokens in results:
        assert builtin_engine.tokenizer.decode(tokens).startswith('{"name": "')
    wait_idle(builtin_engine)
    assert builtin_engine.kv_pages_in_use() == 0


def test_vllms_first_structural_tag_shape_is_read(builtin_engine):
    import xgrammar as xgr

    legacy = {"type": "structural_tag", "triggers": ["<a>"], "structures": [
        {"begin": "<a>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
         "end": "</a>"}]}
    compiled = builtin_engine._core.grammars.compile(Constraint(structural_tag=json.dumps(legacy)))

    def accepts(text):
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts('free text <a>{"x": 1}</a> more')
    assert not accepts('free text <a>{"x": "one"}</a>')


# -- bad constraints: the caller's fault, named ---------------------------------------------------

@pytest.mark.parametrize("constraint, words", [
    (Constraint(json={"type": "array", "uniqueItems": True}), "/uniqueItems"),
    (Constraint(json="{not json"), "not valid JSON"),
    (Constraint(json={"type": "object", "minProperties": 2}), "minProperties"),
    (Constraint(regex="(unclosed"), "parenthesis"),
    (Constraint(grammar="root ::= undefined_rule"), "undefined_rule"),
    (Constraint(structural_tag="{}"), "structural_tag"),
    (Constraint(structural_tag=json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"type": "array", "uniqueItems": True}}})), "/uniqueItems"),
])
def test_invalid_constraints_are_refused_before_they_run(builtin_engine, constraint, words):
    prompt = chat_prompt(builtin_engine, "hi")
    with pytest.raises(InvalidRequestError) as err:
        list(builtin_engine.generate(prompt, SamplingParams(max_tokens=2, structured_outputs=constraint)))
    assert err.value.param == "structured_outputs" and words in str(err.value)
    assert "/project/" not in str(err.value)  # xgrammar's source position is no use to a caller


def test_a_constraint_no_token_can_continue_fails_its_request_as_the_callers_fault(builtin_engine):
    # U+40000 compiles, but no token of the built-in vocabulary spells it: a dead end at run time.
    params = SamplingParams(max_tokens=5, structured_outputs=Constraint(json={"const": "\U00040000"}))
    with pytest.raises(InvalidRequestError, match="no token of this model's vocabulary") as err:
        list(builtin_engine.generate(chat_prompt(builtin_engine, "hi"), params))
    assert err.value.param == "structured_outputs"
    wait_idle(builtin_engine)
    assert builtin_engine.kv_pages_in_use() == 0


def test_grammars_compile_in_the_callers_thread(builtin_engine, monkeypatch):
    compiler = builtin_engine._core.grammars._get_compiler()
    threads = []
    original = type(compiler).compile_regex

    def spy(self, regex):
        threads.append(threading.current_thread().name)
        return original(self, regex)

    monkeypatch.setattr(type(compiler), "compile_regex", spy)
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=Constraint(regex="[a-c]{3}x"))
    text, _ = text_of(builtin_engine, chat_prompt(builtin_engine, "hi"), params)
    assert re.fullmatch("[a-c]{3}x", text)
    # validate() compiled it in this thread; the engine thread's add_request asks xgrammar's cache.
    assert threads[0] == threading.current_thread().name and "lmserve-engine" not in threads[:1]


# -- speculative decoding: drafts checked against the grammar, output unchanged ----------------

@pytest.mark.parametrize("width", [1, 2])
def test_speculation_keeps_constrained_output_identical(builtin_engine, width):
    prompts = [chat_prompt(builtin_engine, f"Describe person number {i} as JSON.") for i in range(3)]
    constraints = [Constraint(json=PERSON), Constraint(json_object=True),
                   Constraint(regex=r"(ab|abc)+[0-9]{2}")]
    runs = [(p, SamplingParams(temperature=0, max_tokens=60, structured_outputs=c))
            for p, c in zip(prompts, constraints)]
    want = [generate_tokens(builtin_engine, p, params) for p, params in runs]
    spec = Engine(max_num_sequence=4, verbose=False, speculative_mode="ngram", spec_draft_length=4,
                  spec_tree_width=width)
    try:
        got = [generate_tokens(spec, p, params) for p, params in runs]
        assert got == want
        assert spec.stats().spec_num_accepted_tokens > 0
        # Prompt lookup drafts the end of turn after "}" from an earlier answer in the history:
        # a draft path past the grammar's end is no row to fill (once a crash of the whole step).
        history = builtin_engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "JSON please."}, {"role": "assistant", "content": '{"a": 1}'},
             {"role": "user", "content": "Again, the same JSON."}])
        params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=Constraint(regex=r'\{"a": [0-9]\}'))
        before = spec.stats().spec_num_accepted_tokens
        tokens = generate_tokens(spec, history, params)
        assert tokens == generate_tokens(builtin_engine, history, params)
        assert re.fullmatch(r'\{"a": [0-9]\}', builtin_engine.tokenizer.decode(tokens))
        assert spec.stats().spec_num_accepted_tokens > before
    finally:
        spec.shutdown()

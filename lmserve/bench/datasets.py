"""Synthetic benchmark prompts: ``random``, ``shared-prefix`` and ``json-schema`` (random prompts,
each request asking for output that follows a JSON schema).

Lengths follow vLLM ``bench serve``'s random dataset: with base length ``L`` and range ratio
``R`` (0 <= R < 1), each request's length is drawn uniformly from the integers
``[int(L * (1 - R)), int(L * (1 + R))]``, both ends included; input and output lengths alike
(an output length is at least 1, an input length too, since an empty prompt is refused).

A prompt is sent as text, so its tokens must survive the text round trip: random ids decode to
a text that may tokenize differently (two pieces merge, a lone byte becomes U+FFFD). Each prompt
is therefore rebuilt until its text tokenizes to exactly the ids it was made of, so the
reported ``prompt_len`` is what the tokenizer measures, not a target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from lmserve.bench.tokenizers import PromptTokenizer

# Rebuilding converges in one or two rounds (measured on the built-in tokenizer at 8..4096
# tokens); this bound only stops a tokenizer whose texts never round-trip.
_MAX_ROUNDS = 20


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt text, its length in tokens and the tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int
    json_schema: Optional[dict[str, Any]] = None  # the output must follow it (structured output)


# A typical structured-output schema (a record with nested objects, an enum, a bounded list); its
# list of free-form notes lets an answer run as long as the benchmark asks.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "email", "role", "address", "tags", "notes"],
}


def length_range(length: int, range_ratio: float, minimum: int = 1) -> tuple[int, int]:
    """The inclusive range lengths are drawn from: ``[int(L(1-R)), int(L(1+R))]``, floored at
    ``minimum``."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if length < minimum:
        raise ValueError(f"length must be at least {minimum}, got {length}")
    return max(minimum, int(length * (1 - range_ratio))), int(length * (1 + range_ratio))


def _draw_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> list[int]:
    low, high = length_range(length, range_ratio)
    return rng.integers(low, high + 1, size=count).tolist()


class _PromptBuilder:
    """Texts of random tokens that tokenize back to exactly those tokens."""

    def __init__(self, tokenizer: PromptTokenizer, rng: np.random.Generator) -> None:
        self._tokenizer = tokenizer
        self._rng = rng
        self._pool = np.asarray(tokenizer.token_pool())
        if self._pool.size == 0:
            raise ValueError(f"tokenizer {tokenizer.name} offers no tokens to build prompts from")

    def _random_ids(self, count: int) -> list[int]:
        return self._rng.choice(self._pool, size=count).tolist()

    def build(self, head: Sequence[int], length: int) -> tuple[str, list[int]]:
        """A text whose tokens are ``head`` followed by random tokens, ``length`` in all."""
        head = list(head)
        ids = head + self._random_ids(length - len(head))
        for _ in range(_MAX_ROUNDS):
            text = self._tokenizer.decode(ids)
            again = self._tokenizer.encode(text)
            if again == ids:
                return text, ids
            # Keep what re-tokenized stably and redraw the rest; a head merged with the first
            # random token would no longer be shared, so then all the random part is redrawn.
            tail = again[len(head):length] if again[:len(head)] == head else []
            ids = head + tail + self._random_ids(length - len(head) - len(tail))
        raise RuntimeError(f"tokenizer {self._tokenizer.name}: no text of {length} random tokens "
                           f"tokenized back to itself in {_MAX_ROUNDS} rounds")


def random_dataset(tokenizer: PromptTokenizer, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` prompts of random tokens, lengths drawn as the module docstring says."""
    rng = np.random.default_rng(seed)
    input_lens = _draw_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _draw_lengths(rng, output_len, range_ratio, num_prompts)
    builder = _PromptBuilder(tokenizer, rng)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        text, ids = builder.build([], n_in)
        requests.append(SampleRequest(text, len(ids), n_out))
    return requests


def json_schema_dataset(tokenizer: PromptTokenizer, num_prompts: int, input_len: int, output_len: int,
                        range_ratio: float = 0.0, seed: int = 0,
                        schema: Optional[dict[str, Any]] = None) -> list[SampleRequest]:
    """The ``random`` dataset's requests, each asking for output that follows ``schema``
    (``BENCH_SCHEMA`` by default): what constraining every request costs."""
    schema = BENCH_SCHEMA if schema is None else schema
    return [dataclasses.replace(r, json_schema=schema)
            for r in random_dataset(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)]


def shared_prefix_dataset(tokenizer: PromptTokenizer, num_prompts: int, prefix_len: int,
                          num_prefixes: int, suffix_len: int, output_len: int,
                          range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes of ``prefix_len`` tokens, each followed by distinct
    random suffixes (lengths drawn around ``suffix_len``), in shuffled order.

    The prompts of one prefix share its first ``prefix_len`` tokens exactly, which is what a
    prefix cache can reuse. The prompts are split among the prefixes as evenly as possible.
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be at least 1, got {num_prefixes}")
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be at least 1, got {prefix_len}")
    rng = np.random.default_rng(seed)
    suffix_lens = _draw_lengths(rng, suffix_len, range_ratio, num_prompts)
    output_lens = _draw_lengths(rng, output_len, range_ratio, num_prompts)
    builder = _PromptBuilder(tokenizer, rng)
    prefixes = [builder.build([], prefix_len)[1] for _ in range(num_prefixes)]
    requests = []
    seen: set[str] = set()
    for i, (n_suffix, n_out) in enumerate(zip(suffix_lens, output_lens)):
        prefix = prefixes[i % num_prefixes]
        # A repeated suffix would make a whole prompt a cache hit; short suffixes can repeat.
        for _ in range(_MAX_ROUNDS):
            text, ids = builder.build(prefix, prefix_len + n_suffix)
            if text not in seen:
                break
        else:
            raise ValueError(f"could not draw {num_prompts} distinct suffixes of ~{suffix_len} tokens")
        seen.add(text)
        requests.append(SampleRequest(text, len(ids), n_out))
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]

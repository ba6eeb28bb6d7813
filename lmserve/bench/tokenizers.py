"""The tokenizer a benchmark builds its prompts with: the server's own, or a local one.

Prompts are made of random tokens, and their lengths are counted in the server's tokens, so the
best tokenizer is the server's: its ``/tokenize`` and ``/detokenize`` endpoints (vLLM and
llama.cpp spell them differently; both are understood). Without them a local lmserve
``Tokenizer`` is used, of ``--tokenizer PATH`` or of the built-in model.
"""

from __future__ import annotations

import json
import random
import string
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

# What a request to /tokenize or /detokenize may take; the server is local or near.
_HTTP_TIMEOUT_S = 30.0


class PromptTokenizer(Protocol):
    """What the dataset generators need from a tokenizer."""

    name: str  # shown in the report and written as ``tokenizer_id``

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens (no bos)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""

    def token_pool(self) -> list[int]:
        """The ids random prompts are drawn from: ordinary tokens, no special ones."""


class LocalTokenizer:
    """An lmserve ``Tokenizer`` (Hugging Face fast tokenizer) in this process."""

    def __init__(self, model: Optional[str]) -> None:
        """Load the tokenizer of ``model``: a Hugging Face directory, a GGUF file, or None
        for the built-in model."""
        from lmserve.tokenizer import Tokenizer  # transformers is slow to import; only when used

        self.name = model or "lmserve built-in model"
        self._tokenizer = Tokenizer.from_model(model)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_pool(self) -> list[int]:
        # Added tokens are the special ones (bos, eos, chat markers): a prompt full of them
        # would test the chat template's handling, not serving.
        added = set(self._tokenizer.hf.added_tokens_decoder)
        return [i for i in range(self._tokenizer.vocab_size) if i not in added]


@dataclass(frozen=True)
class _Dialect:
    """How one server family spells its tokenize / detokenize bodies."""

    name: str
    tokenize_body: Callable[[str, str], dict[str, Any]]  # (model, text) -> body
    detokenize_body: Callable[[str, list[int]], dict[str, Any]]  # (model, ids) -> body
    text_key: str  # where /detokenize's answer holds the text


_DIALECTS = (
    _Dialect("vllm", lambda model, text: {"model": model, "prompt": text, "add_special_tokens": False},
             lambda model, ids: {"model": model, "tokens": ids}, "prompt"),
    _Dialect("llama.cpp", lambda model, text: {"content": text, "add_special": False},
             lambda model, ids: {"tokens": ids}, "content"),
)


def _post_json(url: str, body: dict[str, Any], api_key: Optional[str]) -> Any:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
        return json.load(response)


class RemoteTokenizer:
    """The server's tokenizer through its ``/tokenize`` and ``/detokenize`` endpoints."""

    def __init__(self, base_url: str, model: str, api_key: Optional[str], dialect: _Dialect) -> None:
        """Use ``dialect``'s endpoints at ``base_url``; ``probe`` finds the dialect."""
        self.name = f"{base_url}/tokenize"
        self._base_url = base_url
        self._model = model
        self._api_key = api_key
        self._dialect = dialect

    @classmethod
    def probe(cls, base_url: str, model: str, api_key: Optional[str]) -> Optional["RemoteTokenizer"]:
        """The server's tokenizer, or None when it has no /tokenize + /detokenize that work."""
        for dialect in _DIALECTS:
            candidate = cls(base_url, model, api_key, dialect)
            try:
                ids = candidate.encode("Hello world")
                if ids and candidate.decode(ids).strip() == "Hello world":
                    return candidate
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not this dialect (404, 400 for unknown fields, other answer shape)
        return None

    def encode(self, text: str) -> list[int]:
        answer = _post_json(f"{self._base_url}/tokenize",
                            self._dialect.tokenize_body(self._model, text), self._api_key)
        tokens = answer["tokens"]
        if not all(isinstance(t, int) for t in tokens):
            raise TypeError("/tokenize answered something other than token ids")
        return tokens

    def decode(self, token_ids: Sequence[int]) -> str:
        answer = _post_json(f"{self._base_url}/detokenize",
                            self._dialect.detokenize_body(self._model, list(token_ids)), self._api_key)
        text = answer[self._dialect.text_key]
        if not isinstance(text, str):
            raise TypeError("/detokenize answered something other than text")
        return text

    def token_pool(self) -> list[int]:
        # Neither API tells the vocabulary size, so the pool is the tokens of random words:
        # ordinary text pieces, never special tokens. A fixed seed keeps it the same every run.
        rng = random.Random(0)
        words = ("".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9))) for _ in range(3000))
        return sorted(set(self.encode(" ".join(words))))


def resolve_tokenizer(path: Optional[str], base_url: str, model: str,
                      api_key: Optional[str]) -> PromptTokenizer:
    """``--tokenizer PATH`` when given; else the server's /tokenize; else the built-in model's."""
    if path is None:
        remote = RemoteTokenizer.probe(base_url, model, api_key)
        if remote is not None:
            return remote
    return LocalTokenizer(path)

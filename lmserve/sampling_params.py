"""Per-request generation settings: how to pick each token, how many, and when to stop."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from lmserve.structured.params import StructuredOutputsParams

MAX_STOP_STRINGS = 16  # OpenAI allows 4; more only slows the per-token stop-string scan
MAX_LOGPROBS = 20  # OpenAI's limit on top alternatives per position
MAX_PENALTY = 2.0  # OpenAI's range for frequency and presence penalties is [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values is [-100, 100]
# Beyond these the multiplicative rule only makes float32 logits overflow or collapse to 0.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1

# OpenAI sends logit_bias keys as JSON strings; only plain decimal integers are token ids.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a count or token id is always a client bug.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _range_text(lo: Optional[float], hi: Optional[float], lo_open: bool) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}]"


def _check_int(
    name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None
) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {_range_text(lo, hi, False)}, got {value!r}")
    return int(value)


def _check_float(
    name: str,
    value: Any,
    lo: Optional[float] = None,
    hi: Optional[float] = None,
    lo_open: bool = False,
) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    too_low = lo is not None and (number <= lo if lo_open else number < lo)
    if too_low or (hi is not None and number > hi):
        raise ValueError(f"{name} must be {_range_text(lo, hi, lo_open)}, got {value!r}")
    return number


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def _check_stop(value: Any) -> list[str]:
    if value is None:
        return []
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(
            f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(strings)}: {value!r}"
        )
    for string in strings:
        if not isinstance(string, str):
            raise ValueError(f"stop must hold only strings, got {string!r} in {value!r}")
        if not string:
            raise ValueError(f"stop must not hold an empty string, got {value!r}")
    return list(strings)


def _check_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {value!r}")
    return [_check_int("stop_token_ids entry", token_id, lo=0) for token_id in value]


def _check_logit_bias(value: Any) -> Optional[dict[int, float]]:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {value!r}")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key):
            token_id = int(key)
        elif _is_int(key):
            token_id = int(key)
        else:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        if token_id in biases:
            raise ValueError(f"logit_bias names token id {token_id} twice (key {key!r})")
        biases[token_id] = _check_float(
            f"logit_bias[{key!r}]", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS
        )
    return biases


@dataclass
class SamplingParams:
    """How one request wants its tokens chosen, in the spirit of OpenAI's and vLLM's APIs.

    Checked on construction: a bad value raises ``ValueError`` naming the field and the value.
    Some fields are normalised: ``stop`` may be given as one string or None, ``stop_token_ids``
    as None, and ``logit_bias`` keys as decimal strings (as OpenAI clients send them); after
    construction they are a list of strings, a list of ints and a dict keyed by int.
    """

    n: int = 1  # number of choices generated for the prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose mass reaches top_p
    top_k: int = -1  # keep the top_k most likely tokens; -1 or 0 disables
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    # HF/vLLM rule over prompt and output tokens: positive logits divided by it, others multiplied.
    repetition_penalty: float = 1.0
    # OpenAI rules over output tokens: logit -= frequency * count + presence * (count > 0).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None  # added to the logits, token id -> [-100, 100]
    seed: Optional[int] = None  # seeds the request's own generator; None draws a fresh one
    stop: list[str] = field(default_factory=list)  # strings that end a choice
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end a choice
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence tokens
    max_tokens: Optional[int] = None  # None: until the context is full; 0: the prompt only
    min_tokens: int = 0  # no stop or eos token may be chosen before this many tokens
    logprobs: Optional[int] = None  # None: off; k: chosen token's logprob and k top alternatives
    # None: off; k: each prompt token's logprob given the tokens before it, and the k most likely
    # tokens at its position (vLLM's name; OpenAI's ``echo`` with ``logprobs``).
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    # The grammar the output must follow (JSON schema, regex, ...); it also ends the output.
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, lo=1)
        self.temperature = _check_float("temperature", self.temperature, lo=0.0)
        self.top_p = _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        self.top_k = _check_int("top_k", self.top_k, lo=-1)
        self.min_p = _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        self.repetition_penalty = _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            lo=MIN_REPETITION_PENALTY,
            hi=MAX_REPETITION_PENALTY,
        )
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, lo=-MAX_PENALTY, hi=MAX_PENALTY
        )
        self.presence_penalty = _check_float(
            "presence_penalty", self.presence_penalty, lo=-MAX_PENALTY, hi=MAX_PENALTY
        )
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, lo=MIN_SEED, hi=MAX_SEED)
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, lo=0)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, lo=0,
                                              hi=MAX_LOGPROBS)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{self.structured_outputs!r}")
            if self.min_tokens:
                # The grammar decides where the output ends; banning its end would leave no token.
                raise ValueError("min_tokens cannot be combined with structured output")

    def stop_ids(self, eos_token_ids) -> list[int]:
        """The token ids that end a choice when chosen (before ``min_tokens``, banned):
        ``stop_token_ids`` and, unless ``ignore_eos``, the model's ``eos_token_ids``."""
        return [*self.stop_token_ids, *(() if self.ignore_eos else eos_token_ids)]

    @property
    def is_greedy(self) -> bool:
        """True when every token is the most likely one (temperature 0): no randomness at all."""
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids that the model's vocabulary of ``vocab_size`` tokens does not have.

        Raises ``OutOfVocabularyError`` naming the field and the first offending id.
        """
        for name, token_ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                raise OutOfVocabularyError(
                    name, f"{name} token id {bad} is outside the vocabulary (ids 0..{vocab_size - 1})")


class OutOfVocabularyError(ValueError):
    """A token id the model's vocabulary does not have; ``field`` names where it was given."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

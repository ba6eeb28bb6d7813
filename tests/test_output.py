"""OutputProcessor: a step's new tokens of a sequence come as a list (speculative decoding accepts
runs of them); every stop rule acts inside a run exactly as with one token a step."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.engine.output import OutputProcessor
from lmserve.outputs import TokenLogprob
from lmserve.request import Request, Sequence
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer

PROMPT = [1, 504, 3458]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model(None)


def _seq(params: SamplingParams) -> Sequence:
    return Sequence(Request("r", list(PROMPT), params), 0, list(PROMPT), None)


def _run(processor: OutputProcessor, params: SamplingParams, pieces: list[list[int]]):
    """Feed the tokens in the given pieces; what the caller would have seen, all together."""
    seq = _seq(params)
    text, kept, logprobs = "", [], []
    for piece in pieces:
        if seq.finish_reason is not None:
            break
        delta = processor.append(seq, piece, [TokenLogprob(t, -0.5, []) for t in piece])
        text += delta.text
        kept += delta.token_ids
        logprobs += [lp.token_id for lp in delta.logprobs]
    assert kept == logprobs == seq.output_token_ids  # the logprobs of exactly the tokens kept
    return text, kept, seq.finish_reason, seq.stop_reason


def test_a_stop_string_inside_a_run_drops_the_tokens_after_it(tok):
    processor = OutputProcessor(tok, max_sequence_length=1000)
    tokens = tok.encode(" one two three four five")
    params = SamplingParams(max_tokens=50, stop=[" three"])
    text, kept, finish, stop = _run(processor, params, [tokens])
    assert (text, finish, stop) == (" one two", "stop", " three")
    assert kept == tokens[:3]  # up to the token that completed the stop string


def test_max_tokens_and_stop_token_ids_inside_a_run(tok):
    tokens = tok.encode(" a b c d e")
    processor = OutputProcessor(tok, max_sequence_length=1000)
    _, kept, finish, _ = _run(processor, SamplingParams(max_tokens=2), [tokens])
    assert (kept, finish) == (tokens[:2], "length")
    _, kept, finish, stop = _run(processor, SamplingParams(max_tokens=50, stop_token_ids=[tokens[2]]), [tokens])
    assert (kept, finish, stop) == (tokens[:3], "stop", tokens[2])


_WORDS = [" a", " b", " ab", " ba", " stop", " c"]


@settings(max_examples=150, deadline=None)
@given(words=st.lists(st.sampled_from(_WORDS), min_size=1, max_size=12),
       cuts=st.lists(st.integers(0, 12), max_size=5),
       max_tokens=st.integers(1, 14), min_tokens=st.integers(0, 4),
       stop=st.lists(st.sampled_from([" b a", "ab", " stop", "c"]), max_size=2),
       stop_id_word=st.sampled_from([None, " c", " ba"]))
def test_any_split_into_runs_gives_what_one_token_a_step_gives(tok, words, cuts, max_tokens, min_tokens,
                                                                 stop, stop_id_word):
    tokens = [t for w in words for t in tok.encode(w)]
    stop_ids = tok.encode(stop_id_word) if stop_id_word else []
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), stop=stop,
                            stop_token_ids=stop_ids[:1], ignore_eos=False)
    processor = OutputProcessor(tok, max_sequence_length=len(PROMPT) + 10)
    bounds = [0, *sorted({c % (len(tokens) + 1) for c in cuts}), len(tokens)]
    runs = [tokens[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    assert _run(processor, params, runs) == _run(processor, params, [[t] for t in tokens])

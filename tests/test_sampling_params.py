"""Validation and normalisation of SamplingParams."""

import math

import pytest

from lmserve.sampling_params import MAX_STOP_STRINGS, OutOfVocabularyError, SamplingParams


def test_defaults_are_valid_and_random():
    params = SamplingParams()
    assert params.n == 1
    assert params.stop == [] and params.stop_token_ids == []
    assert params.logit_bias is None and params.max_tokens is None
    assert not params.is_greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", -1),
        ("n", 1.0),
        ("n", True),
        ("n", "2"),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.5"),
        ("temperature", None),
        ("temperature", False),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.inf),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 1000.0),
        ("repetition_penalty", math.nan),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", -math.inf),
        ("presence_penalty", 3),
        ("presence_penalty", -2.5),
        ("presence_penalty", math.nan),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"1.5": 1.0}),
        ("logit_bias", {" 7": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"-3": 1.0}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {1.0: 1.0}),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {1: -100.5}),
        ("logit_bias", {1: math.nan}),
        ("logit_bias", {1: "5"}),
        ("logit_bias", {1: 1.0, "1": 2.0}),
        ("seed", 1.5),
        ("seed", True),
        ("seed", "42"),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", ""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop", {"a": 1}),
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
        ("stop_token_ids", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, 2.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", "12"),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("max_tokens", -5),
        ("max_tokens", 10.0),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("min_tokens", 1.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("logprobs", True),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", 2.0),
        ("skip_special_tokens", None),
        ("skip_special_tokens", 0),
        ("include_stop_str_in_output", "false"),
    ],
)
def test_bad_value_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    assert field in str(excinfo.value)


def test_bad_value_is_named_in_the_message():
    with pytest.raises(ValueError, match=r"top_p .*1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"logit_bias.*'abc'"):
        SamplingParams(logit_bias={"abc": 1.0})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
    assert SamplingParams(min_tokens=100).min_tokens == 100  # no max: until the context limit


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=3, temperature=0, top_p=1, top_k=0, min_p=1),
        dict(temperature=2, top_k=-1, top_p=1e-9, min_p=0),
        dict(repetition_penalty=0.01),
        dict(repetition_penalty=100),
        dict(frequency_penalty=-2, presence_penalty=2),
        dict(logit_bias={5: -100, 6: 100}),
        dict(seed=0),
        dict(seed=2**64 - 1),
        dict(seed=-(2**63)),
        dict(max_tokens=1, min_tokens=1),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True),
    ],
)
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_numbers_are_normalised():
    params = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(params.temperature, float)
    assert isinstance(params.top_p, float)
    assert isinstance(params.repetition_penalty, float)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=["x"] * MAX_STOP_STRINGS).stop == ["x"] * MAX_STOP_STRINGS


def test_stop_token_ids_none_is_an_empty_list():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(2, 3)).stop_token_ids == [2, 3]


def test_caller_lists_are_copied():
    stop = ["a"]
    params = SamplingParams(stop=stop)
    stop.append("b")
    assert params.stop == ["a"]


def test_logit_bias_string_keys_become_ints():
    params = SamplingParams(logit_bias={"50256": -100, 7: 2.5, "0": 1})
    assert params.logit_bias == {50256: -100.0, 7: 2.5, 0: 1.0}
    assert all(type(key) is int for key in params.logit_bias)
    assert all(type(value) is float for value in params.logit_bias.values())


def test_is_greedy_only_at_temperature_zero():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    assert not SamplingParams(top_k=1).is_greedy


def test_check_vocab_accepts_ids_inside():
    SamplingParams(logit_bias={"99": 1.0}, stop_token_ids=[0, 99]).check_vocab(100)
    SamplingParams().check_vocab(1)


@pytest.mark.parametrize(
    "kwargs, field, token_id",
    [
        (dict(logit_bias={"100": 1.0}), "logit_bias", 100),
        (dict(logit_bias={3: 1.0, 12345: -1.0}), "logit_bias", 12345),
        (dict(stop_token_ids=[5, 100]), "stop_token_ids", 100),
        (dict(stop_token_ids=[700]), "stop_token_ids", 700),
    ],
)
def test_check_vocab_refuses_ids_outside(kwargs, field, token_id):
    params = SamplingParams(**kwargs)
    with pytest.raises(OutOfVocabularyError) as excinfo:
        params.check_vocab(100)
    message = str(excinfo.value)
    assert field in message and str(token_id) in message
    assert excinfo.value.field == field

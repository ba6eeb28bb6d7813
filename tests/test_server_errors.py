"""Every error ``lmserve serve`` answers, over raw HTTP: OpenAI's error shape and the right status,
and a fuzz pass that no request body gets a 500 or a dropped connection."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server_process import ServerProcess

KEY = "test-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODY_LIMIT = 4096
CONTEXT = 128


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with ServerProcess(["--model", tiny_model_dir, "--served-model-name", MODEL, "--api-key", KEY,
                        "--max-body-bytes", str(BODY_LIMIT), "--max-waiting", "2",
                        "--max-single-sequence-length", str(CONTEXT), "--max-num-sequence", "4"],
                       log) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30.0) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param=None) -> dict:
    """``r`` is an OpenAI error with this status (and param, when given); returns the error."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_api_key_is_required_except_for_health(server, http):
    url = server.base_url
    assert_error(httpx.post(url + "/v1/chat/completions", json=CHAT), 401)
    error = assert_error(httpx.post(url + "/v1/chat/completions", json=CHAT,
                                    headers={"Authorization": "Bearer wrong"}), 401)
    assert error["code"] == "invalid_api_key"
    assert_error(httpx.get(url + "/v1/models"), 401)
    assert_error(httpx.post(url + "/tokenize", json={"prompt": "x"}), 401)
    assert httpx.get(url + "/health").status_code == 200
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("change, param", [
    ({"temperature": 5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": "two"}, "n"),
    ({"messages": []}, "messages"),
    ({"max_token": 3}, "max_token"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"999999": 1}}, None),
])
def test_a_bad_field_is_a_400_naming_it(http, change, param):
    error = assert_error(http.post("/v1/chat/completions", json={**CHAT, **change}), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe", b"",
                                     b'{"temperature": NaN}', b"[" * 2000 + b"]" * 2000])
def test_a_body_that_is_no_json_object_is_a_400(http, content):
    assert_error(http.post("/v1/completions", content=content), 400)


def test_missing_fields_are_a_400_not_a_422(http):
    assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    assert_error(http.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens")


def test_unknown_model_route_and_method(http):
    error = assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(http.post("/v1/completions", json={"model": "x", "prompt": "hi"}), 404, "model")
    assert_error(http.get("/v1/models/other"), 404, "model")
    assert_error(http.get("/v1/nothing-here"), 404)
    r = http.get("/v1/chat/completions")
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]


def test_a_body_over_the_limit_is_a_413(http):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}
    assert_error(http.post("/v1/chat/completions", json=big), 413)

    def chunked():  # no Content-Length: the bytes read are what counts
        yield json.dumps(big).encode()

    assert_error(http.post("/v1/chat/completions", content=chunked()), 413)
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_prompt_over_the_context_is_a_400_with_both_numbers(http):
    ids = list(range(10, 10 + CONTEXT + 5))
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ids}), 400, "prompt")
    assert str(CONTEXT + 5) in error["message"] and str(CONTEXT) in error["message"]
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2],
                                                            "max_tokens": CONTEXT}), 400, "max_tokens")
    assert str(CONTEXT) in error["message"] and str(CONTEXT - 2) in error["message"]
    error = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [10**7],
                                                            "stream": True}), 400, "prompt")
    assert "vocabulary" in error["message"]


def test_a_full_queue_is_a_429_until_requests_finish(http):
    long = {"model": MODEL, "prompt": "go", "max_tokens": 100, "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with http.stream("POST", "/v1/completions", json=long) as a, \
            http.stream("POST", "/v1/completions", json=long) as b:
        assert a.status_code == b.status_code == 200
        r = http.post("/v1/completions", json=short)
        assert_error(r, 429)
        assert r.headers["retry-after"]
    # The slots come back as soon as the server notices that both clients left.
    deadline = time.monotonic() + 10
    while (r := http.post("/v1/completions", json=short)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200


# -- fuzz ------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_small_int = st.sampled_from([-1, 0, 1, 2, 3, 20, 10**6])
_text = st.text(max_size=12)
# Each field: mostly plausible values (so that many bodies are valid and run), sometimes anything.
_FIELDS = {
    "model": st.sampled_from([MODEL, MODEL, "other", None, 3]),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": _text}), max_size=3) | _json,
    "prompt": _text | st.lists(st.integers(0, 50000), max_size=4)
    | st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2) | _json,
    "max_tokens": st.integers(1, 3) | _small_int | _json,
    "n": st.integers(1, 3) | st.sampled_from([0, 129]) | _json,
    "temperature": st.floats(0, 2) | st.floats(-1, 3) | _json,
    "top_p": st.floats(0.01, 1) | st.floats(-0.5, 1.5),
    "top_k": _small_int,
    "min_p": st.floats(0, 1) | st.floats(-1, 2),
    "stop": _text | st.lists(st.text(max_size=3), max_size=3) | _json,
    "seed": st.integers(0, 2**32) | st.integers(-(2**65), 2**65),
    "logprobs": st.booleans() | st.integers(0, 3) | _small_int,
    "top_logprobs": st.integers(0, 5) | _small_int,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "-1", "x", "99999999"]), st.floats(-200, 200),
                                  max_size=2),
    "stream": st.booleans(),
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
    "echo": st.booleans(),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(0, 3),
    "stop_token_ids": st.lists(_small_int, max_size=3),
    "min_tokens": st.integers(0, 3) | _small_int,
    "ignore_eos": st.booleans(),
    "add_special_tokens": st.booleans() | _json,
    "user": _text,
    "response_format": _json,
    "tools": _json,
    "self": _json,
}
_BASES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
}
_SHARED = ["model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
           "logit_bias", "stream", "stream_options", "presence_penalty", "repetition_penalty",
           "stop_token_ids", "min_tokens", "ignore_eos", "user", "self"]
_PATH_FIELDS = {  # what each endpoint takes, plus a field or two it refuses
    "/v1/chat/completions": _SHARED + ["messages", "logprobs", "top_logprobs", "response_format", "tools",
                                       "prompt"],
    "/v1/completions": _SHARED + ["prompt", "logprobs", "echo", "messages"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "tools", "self"],
}


def _changes(path: str) -> st.SearchStrategy[dict]:
    return st.lists(st.sampled_from(_PATH_FIELDS[path]), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: _FIELDS[k] for k in keys}))


_requests = st.sampled_from(sorted(_BASES)).flatmap(lambda path: st.tuples(st.just(path), _changes(path)))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=_requests)
def test_fuzzed_bodies_get_a_200_or_an_openai_4xx(http, request):
    path, changes = request
    body = {**_BASES[path], **changes}
    # Keep generations short whatever the fuzzer chose: the point is the answer's shape.
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3
    r = http.post(path, json=body)
    event(f"{path} {r.status_code}")
    if r.status_code == 200:
        if body.get("stream") is True:
            assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
        else:
            assert "error" not in r.json()
    else:
        assert r.status_code in (400, 404, 413), r.text
        assert_error(r, r.status_code)


def test_still_serving_after_everything(http):
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

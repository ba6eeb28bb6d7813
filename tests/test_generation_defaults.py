"""Sampling defaults that fit the model: read from generation_config.json (llama.cpp's for a GGUF
file), used for what a request leaves unset, shown by ``lmserve plan``, off with ``none``."""

from __future__ import annotations

import json

import pytest

from lmserve.cli import main
from lmserve.frontend.openai.facades import Chat, Completions
from lmserve.frontend.openai.protocol import ChatCompletionRequest
from lmserve.generation_defaults import LLAMA_CPP_DEFAULTS, GenerationDefaults, read_generation_defaults
from lmserve.models.builtin import builtin_model_path
from test_openai_api import MESSAGES, FakeBackend


def test_a_gguf_file_gets_llama_cpp_defaults_and_a_directory_its_generation_config(tmp_path):
    gguf = read_generation_defaults(builtin_model_path())
    assert gguf.values == LLAMA_CPP_DEFAULTS and "llama.cpp" in gguf.source
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": None, "do_sample": True}))
    assert read_generation_defaults(str(tmp_path)).values == {"temperature": 0.6, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert read_generation_defaults(str(tmp_path)).values == {}
    assert read_generation_defaults(str(tmp_path / "missing")).values == {}
    assert read_generation_defaults(builtin_model_path(), "none").values == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        read_generation_defaults(str(tmp_path))  # the model's fault, at start, not in each request
    with pytest.raises(ValueError, match="generation_config"):
        read_generation_defaults(builtin_model_path(), "vllm")


def test_the_defaults_fill_only_what_the_request_leaves_unset():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1}
    request = ChatCompletionRequest.parse({"messages": MESSAGES})
    params = request.to_sampling_params(None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (0.6, 0.9, 20, 0.1, 1.1)
    explicit = ChatCompletionRequest.parse({"messages": MESSAGES, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                            "min_p": 0.0, "repetition_penalty": 1.0})
    params = explicit.to_sampling_params(None, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (1.0, 1.0, -1, 0.0, 1.0)
    openai = request.to_sampling_params(None)
    assert (openai.temperature, openai.top_p, openai.top_k, openai.min_p) == (1.0, 1.0, -1, 0.0)


def test_the_facades_use_the_backends_defaults():
    backend = FakeBackend()
    backend.generation_defaults = GenerationDefaults(dict(LLAMA_CPP_DEFAULTS), "test")
    Chat(backend).completions.create(messages=MESSAGES)
    Completions(backend).create(prompt="hi", temperature=0)
    chat, completion = backend.calls[0][2], backend.calls[1][2]
    assert (chat.temperature, chat.top_k, chat.top_p, chat.min_p) == (0.8, 40, 0.95, 0.05)
    assert (completion.temperature, completion.top_k) == (0.0, 40)


def test_the_engine_reads_them_and_plan_shows_them(builtin_engine, capsys):
    assert builtin_engine.generation_defaults.values == LLAMA_CPP_DEFAULTS
    assert main(["plan"]) == 0
    assert "sampling defaults: temperature=0.8 top_k=40 top_p=0.95 min_p=0.05" in capsys.readouterr().out
    assert main(["plan", "--generation-config", "none"]) == 0
    assert "sampling defaults: none" in capsys.readouterr().out

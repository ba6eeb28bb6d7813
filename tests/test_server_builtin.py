"""``lmserve serve`` on the built-in model (SmolLM2-135M-Instruct): a real model answers sensibly."""

from __future__ import annotations

import openai
import pytest

from server_process import ServerProcess


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with ServerProcess(["--max-num-sequence", "4"], log) as proc, \
            openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_the_built_in_model_knows_the_capital_of_france(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")

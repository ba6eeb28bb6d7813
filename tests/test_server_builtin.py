"""``lmserve serve`` on the built-in model (SmolLM2-135M-Instruct): a real model answers sensibly."""

from __future__ import annotations


def test_the_built_in_model_knows_the_capital_of_france(builtin_client):
    client = builtin_client
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

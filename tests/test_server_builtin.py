"""``lmserve serve`` on the built-in model (SmolLM2-135M-Instruct): a real model answers sensibly."""

from __future__ import annotations

from lmserve.models.builtin import builtin_model_path
from lmserve.tokenizer import Tokenizer


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


def test_loglikelihood_as_lm_evaluation_harness_asks_for_it(builtin_client):
    """lm-evaluation-harness's ``local-completions`` scores a continuation by sending context and
    continuation as token ids with echo, logprobs and one token to generate, and summing the
    continuation's token_logprobs (``[ctxlen:-1]``): the model prefers the right answer."""
    tok = Tokenizer.from_model(builtin_model_path())
    model = builtin_client.models.list().data[0].id
    context = tok.encode("The capital of France is", add_special_tokens=False)

    def score(continuation: str) -> tuple[float, bool]:
        ids = context + tok.encode(continuation, add_special_tokens=False)
        r = builtin_client.completions.create(model=model, prompt=ids, echo=True, logprobs=1,
                                              max_tokens=1, temperature=0)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
        greedy = all(v == max(top.values()) for v, top in
                     zip(lp.token_logprobs[len(context):-1], lp.top_logprobs[len(context):-1]))
        return sum(lp.token_logprobs[len(context):-1]), greedy

    paris, paris_greedy = score(" Paris")
    berlin, berlin_greedy = score(" Berlin")
    assert paris > berlin and paris_greedy and not berlin_greedy
    scored = builtin_client.completions.create(model=model, prompt="The capital of France is Paris",
                                               echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == "The capital of France is Paris" and choice.finish_reason == "length"
    assert choice.logprobs.tokens[-1] == " Paris" and len(choice.logprobs.top_logprobs[-1]) == 2

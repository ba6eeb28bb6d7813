"""``lmserve serve`` on the tiny random model, driven by the official ``openai`` client (sync and
async): chat and text completions, streaming or not, n, logprobs, stop, seed, usage."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from server_process import ServerProcess, metric

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
LONG = {"ignore_eos": True}  # the random model may pick eos at any point; these tests want lengths


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with ServerProcess(["--model", tiny_model_dir, "--served-model-name", MODEL,
                        "--max-num-sequence", "8"], log) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with server.openai_client() as c:
        yield c


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_usage_counts_the_prompt_and_the_returned_tokens(client, server):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, logprobs=True,
                                       top_logprobs=2, temperature=0, extra_body=LONG)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 7 == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert r.usage.prompt_tokens == len(server.tokenize(messages=MESSAGES))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_stream_matches_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=9, temperature=0, extra_body=LONG)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_n_choices_each_finish(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=4, seed=1,
                                       extra_body=LONG)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 12
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=4,
                                            seed=1, stream=True, extra_body=LONG)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream
                if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                              temperature=1.0, seed=seed,
                                              extra_body=LONG).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_string_ends_the_choice_before_it(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body=LONG)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2:][:3]
    r = client.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_completion_prompt_forms_and_usage(client, server):
    ids = server.tokenize(prompt="Hello there")
    forms = (("Hello there", 1), (["Hello there", "Bye"], 2), (ids, 1), ([ids, ids[:1]], 2))
    for prompt, num_prompts in forms:
        r = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=3, logprobs=1,
                                      extra_body=LONG)
        assert sorted(c.index for c in r.choices) == list(range(2 * num_prompts))
        assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices) == 6 * num_prompts
    r = client.completions.create(model=MODEL, prompt=["Hello there", "Bye"], max_tokens=2, extra_body=LONG)
    assert r.usage.prompt_tokens == len(ids) + len(server.tokenize(prompt="Bye"))


def test_completion_echo_and_stream_usage(client):
    r = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True, extra_body=LONG)
    assert r.choices[0].text.startswith("Echo me")
    chunks = list(client.completions.create(model=MODEL, prompt="Echo me", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, extra_body=LONG))
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"


def test_sampling_extensions_reach_the_engine(client, server):
    token = server.tokenize(prompt=" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0.7, top_p=0.9,
                                  logit_bias={str(token): 100}, user="tester", frequency_penalty=0.1,
                                  extra_body=dict(top_k=5, min_p=0.01, repetition_penalty=1.0, **LONG))
    assert r.choices[0].text == " banana" * 4


def test_tokenize_and_detokenize_round_trip(server):
    r = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                        "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] > 0
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_async_client_runs_requests_concurrently(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            async def one(i):
                stream = await client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=5 + i, stream=True,
                    stream_options={"include_usage": True}, extra_body=LONG)
                return [c async for c in stream][-1].usage.completion_tokens

            whole = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body=LONG)
            return await asyncio.gather(*(one(i) for i in range(6))), whole.usage.completion_tokens

    streamed, whole = asyncio.run(main())
    assert streamed == [5 + i for i in range(6)] and whole == 3


def test_metrics_count_what_was_served(server, client):
    before = httpx.get(server.base_url + "/metrics").text
    client.completions.create(model=MODEL, prompt="count me", max_tokens=6, extra_body=LONG)
    after = httpx.get(server.base_url + "/metrics").text
    # The same 40-token prompt twice: the second finds its first two 16-token pages cached.
    prompt = list(range(1000, 1040))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    mid = httpx.get(server.base_url + "/metrics").text
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    end = httpx.get(server.base_url + "/metrics").text
    queries, hits = "lmserve:prefix_cache_queries_total", "lmserve:prefix_cache_hits_total"
    assert metric(end, queries) - metric(mid, queries) == 40
    assert metric(end, hits) - metric(mid, hits) == 32
    generated = "lmserve:generation_tokens_total"
    assert metric(after, generated) - metric(before, generated) == 6
    assert metric(after, 'lmserve:request_success_total{finished_reason="length"}') == \
        metric(before, 'lmserve:request_success_total{finished_reason="length"}') + 1
    for name in ("lmserve:time_to_first_token_seconds_count", "lmserve:inter_token_latency_seconds_count",
                 "lmserve:e2e_request_latency_seconds_count", "lmserve:request_queue_time_seconds_count",
                 "lmserve:prompt_tokens_total", "lmserve:num_preemptions_total"):
        assert metric(after, name) >= metric(before, name)
    assert metric(after, "lmserve:e2e_request_latency_seconds_count") > \
        metric(before, "lmserve:e2e_request_latency_seconds_count")

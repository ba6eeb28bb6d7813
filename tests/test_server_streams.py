"""Many clients at once against ``lmserve serve``: streams cut at random points leave nothing
running and no KV page used; 64 concurrent streams all complete with the right usage."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from server_process import ServerProcess, metric, wait_until_idle

MODEL = "tiny"
# --max-waiting, in sequences: 50 cut requests (n of 1 or 2) fit in it; a cut request that kept
# its admission slot shows as a 429 in the burst of MAX_IN_FLIGHT one-sequence requests after them.
MAX_IN_FLIGHT = 100


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with ServerProcess(["--model", tiny_model_dir, "--served-model-name", MODEL,
                        "--max-num-sequence", "16", "--max-waiting", str(MAX_IN_FLIGHT)], log) as proc:
        yield proc


async def _cut_stream(client: httpx.AsyncClient, rng: random.Random) -> None:
    """One stream, left after a random number of events (0: as soon as the headers come)."""
    body = {"model": MODEL, "prompt": "cut me off", "max_tokens": 60, "ignore_eos": True,
            "stream": True, "n": rng.choice([1, 2])}
    events = rng.randrange(0, 30)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events -= 1
                if events < 0:
                    break


async def _cut_before_headers(client: httpx.AsyncClient, rng: random.Random) -> None:
    """A request dropped while the server is still before its first token."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * rng.randrange(50, 400)}],
            "max_tokens": 60, "stream": rng.choice([True, False]), "ignore_eos": True}
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(client.post("/v1/chat/completions", json=body),
                               timeout=rng.uniform(0.0, 0.05))


async def _burst(base_url: str, n: int) -> list[int]:
    """Statuses of ``n`` concurrent one-token requests."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0,
                                 limits=httpx.Limits(max_connections=n)) as client:
        body = {"prompt": "hi", "max_tokens": 1}
        responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))
    return [r.status_code for r in responses]


def test_cut_streams_free_everything(server):
    rng = random.Random(0)

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0, limits=limits) as client:
            cuts = [_cut_stream(client, rng) for _ in range(45)]
            cuts += [_cut_before_headers(client, rng) for _ in range(5)]
            await asyncio.gather(*cuts)

    before = metric(httpx.get(server.base_url + "/metrics").text, "lmserve:request_success_total")
    asyncio.run(main())
    text = wait_until_idle(server.base_url)
    # Each stream is cut well before its 60 tokens, so (CPU starvation aside) all are aborted.
    aborted = metric(text, 'lmserve:request_success_total{finished_reason="abort"}')
    assert aborted >= 45 / 2
    assert metric(text, "lmserve:request_success_total") > before
    # Still serving, and every cut request gave its admission slot back.
    assert asyncio.run(_burst(server.base_url, MAX_IN_FLIGHT)) == [200] * MAX_IN_FLIGHT


def test_a_dropped_non_streaming_request_is_aborted(server):
    # Long enough to run for seconds if nobody stopped it.
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.5)
    text = wait_until_idle(server.base_url, timeout=2.0)
    assert metric(text, "lmserve:generation_tokens_total") > 0


def test_64_concurrent_streams_complete_with_correct_usage(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        max_tokens = 8 + i % 5
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, logprobs=True,
            extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        tokens = sum(len(c.choices[0].logprobs.content) for c in chunks
                     if c.choices and c.choices[0].logprobs)
        assert chunks[-1].usage.completion_tokens == tokens == max_tokens
        return chunks[-1].usage.prompt_tokens, tokens, chunks[-2].choices[0].finish_reason

    async def main():
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=120.0)
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                      max_retries=0, http_client=http) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64 and all(reason == "length" for _, _, reason in results)
    assert len({prompt for prompt, _, _ in results}) >= 1
    wait_until_idle(server.base_url)

"""The load generator: sends the requests (Poisson arrivals, bounded concurrency) and streams
each one, timing its chunks.

Requests go to an OpenAI-compatible ``/v1/completions`` or ``/v1/chat/completions`` with
``stream: true`` and ``stream_options.include_usage`` (the server's token count of the output).
A request's clock starts when it is sent, after any wait for a concurrency slot, as in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
import numpy as np
from tqdm import tqdm

from lmserve.bench.datasets import SampleRequest
from lmserve.bench.metrics import RequestResult

# A request may legitimately take long (a long output on a loaded server), so the only limit
# is a generous one that still ends a hung run (vLLM's is the same 6 hours).
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass(frozen=True)
class Target:
    """Where and how requests are sent."""

    base_url: str  # server root, e.g. http://127.0.0.1:8000
    endpoint: str  # COMPLETIONS_ENDPOINT or CHAT_ENDPOINT
    model: str
    api_key: Optional[str] = None
    temperature: float = 0.0
    ignore_eos: bool = False

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: SampleRequest) -> dict[str, Any]:
        """The JSON body for ``request``."""
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == CHAT_ENDPOINT:
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.output_len
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extension that lmserve and llama.cpp also take
        if request.json_schema is not None:
            if self.endpoint == CHAT_ENDPOINT:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "bench", "schema": request.json_schema}}
            else:  # vLLM's extension of text completions, which lmserve also takes
                body["structured_outputs"] = {"json": request.json_schema}
        return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a stream chunk carries ("" for role-only, finish or usage chunks)."""
    text = ""
    for choice in chunk.get("choices") or ():
        if "delta" in choice:
            text += (choice["delta"] or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, up to ``[DONE]``."""
    async for raw in response.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, event names
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield data


async def send_request(session: aiohttp.ClientSession, target: Target,
                       request: SampleRequest) -> RequestResult:
    """Send one streaming request and time its chunks; never raises for a failed request."""
    result = RequestResult(prompt_len=request.prompt_len)
    pieces: list[str] = []
    start = last = time.perf_counter()
    try:
        async with session.post(target.url, json=target.body(request), headers=target.headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for data in _sse_data(response):
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {json.dumps(chunk['error'])[:500]}"
                    return result
                if usage := chunk.get("usage"):
                    result.output_tokens = usage.get("completion_tokens")
                if text := _chunk_text(chunk):
                    if pieces:
                        result.itl.append(now - last)
                    else:
                        result.ttft = now - start
                    last = now
                    pieces.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnicodeDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.generated_text = "".join(pieces)
    if not pieces:
        result.error = "the stream ended without any generated text"
        return result
    result.latency = last - start
    result.success = True
    return result


def arrival_times(count: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at ``request_rate`` per second;
    all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=count)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


def _session(max_concurrency: Optional[int]) -> aiohttp.ClientSession:
    # aiohttp caps a session at 100 connections unless told otherwise, which would silently
    # bound the concurrency of an unbounded run. A connection per request: a server closes a
    # kept-alive one on its own terms (llama-server's HTTP library after a few requests), and a
    # request written to a connection being closed fails.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True)
    return aiohttp.ClientSession(connector=connector, timeout=_REQUEST_TIMEOUT)


async def first_model(base_url: str, api_key: Optional[str] = None) -> str:
    """The id of the first model the server lists at ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with _session(1) as session, session.get(base_url + "/v1/models", headers=headers) as response:
        response.raise_for_status()
        models = (await response.json())["data"]
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


async def check_request(target: Target, request: SampleRequest) -> RequestResult:
    """Send one request alone (the start-up check that the arguments are right)."""
    async with _session(1) as session:
        return await send_request(session, target, request)


async def run_load(target: Target, requests: Sequence[SampleRequest], request_rate: float = math.inf,
                   max_concurrency: Optional[int] = None, seed: int = 0,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at ``request_rate`` (Poisson) with at most ``max_concurrency`` in flight.

    Returns the results in the order of ``requests`` and the wall-clock duration in seconds,
    from the first send to the last response.
    """
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, unit="req")

    async def one(session: aiohttp.ClientSession, request: SampleRequest) -> RequestResult:
        if semaphore is None:
            result = await send_request(session, target, request)
        else:
            async with semaphore:
                result = await send_request(session, target, request)
        bar.update()
        return result

    async with _session(max_concurrency) as session:
        start = time.perf_counter()
        tasks = []
        for request, at in zip(requests, arrival_times(len(requests), request_rate, seed)):
            # Sleep to an absolute time, so that slow task creation does not stretch the gaps.
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration

"""schemathesis against ``lmserve serve``'s own OpenAPI document: requests generated for every
operation, valid and invalid, never get a 5xx or a dropped connection, every error has OpenAI's
shape, a stream in the background keeps getting tokens, and the server stays within its plan's
memory. Bounded in examples per operation, so it ends by itself in well under a minute."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from lmserve.config import EngineConfig
from lmserve.frontend.server.openapi import openapi_document
from lmserve.models.loader import read_model_args
from lmserve.plan import make_plan
from server_process import ServerProcess

CONTEXT = 64
ENGINE_FLAGS = {"max_single_sequence_length": CONTEXT, "max_num_sequence": 8}
MAX_GAP_S = 3.0  # between two tokens of the background stream, on a busy 2-core machine

# The document the server serves, built in-process so that the cases are known at collection.
schema = schemathesis.openapi.from_dict(openapi_document())
schema.config.generation.update(modes=list(schemathesis.GenerationMode))  # valid and invalid


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with ServerProcess(["--model", tiny_model_dir, "--max-seqs-per-request", "4", *flags], log) as proc:
        yield proc


class BackgroundStream:
    """Streams one long completion after another until stopped; records the longest gap between
    two of a stream's events and anything that went wrong."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.longest_gap = 0.0
        self.streams = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BackgroundStream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        body = {"prompt": "keep talking", "max_tokens": CONTEXT - 8, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.base_url, timeout=30.0) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            self.errors.append(f"status {r.status_code}: {r.read()!r}")
                            continue
                        last = None
                        for line in r.iter_lines():
                            now = time.monotonic()
                            if line.startswith("data: ") and last is not None:
                                self.longest_gap = max(self.longest_gap, now - last)
                            last = now
                    self.streams += 1
                except httpx.HTTPError as err:
                    self.errors.append(repr(err))


@pytest.fixture(scope="module")
def background(server):
    with BackgroundStream(server.base_url) as stream:
        yield stream
    assert not stream.errors, stream.errors
    assert stream.streams >= 1
    assert stream.longest_gap < MAX_GAP_S, f"{stream.longest_gap:.2f} s between two tokens"


@pytest.fixture(scope="module")
def memory_budget(tiny_model_dir) -> int:
    config = EngineConfig(model=tiny_model_dir, **ENGINE_FLAGS)
    return make_plan(config, read_model_args(tiny_model_dir)).memory.total


def rss_bytes(server: ServerProcess) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_5xx_no_dropped_connection_and_openai_errors(case, server, background, memory_budget):
    response = case.call(base_url=server.base_url, timeout=60)  # a dropped connection raises here
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and response.request.method != "HEAD":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert rss_bytes(server) < memory_budget


def test_the_document_describes_every_route(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    assert doc == openapi_document()
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                 "/v1/models/{model}", "/tokenize", "/detokenize", "/health", "/metrics"}
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]

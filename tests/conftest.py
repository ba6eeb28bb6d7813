"""Shared fixtures: engines are expensive to load, so tests share them per session."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any

# lmserve before torch: its import sets libgomp's spinning (lmserve/openmp.py).
from lmserve import AsyncEngine, Engine, SamplingParams  # isort: skip
import pytest
import torch

from lmserve.models.builtin import builtin_model_path
from server_process import ServerProcess
from tiny_models import make_hf_llama

# Tests run on a shared 2-core machine; more threads than cores only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def builtin_engine():
    """The built-in model at the default opt level, room for 8 sequences: the invariants
    (batch company, preemption, prefix cache) are checked on the path users get."""
    engine = Engine(max_num_sequence=8, max_total_sequence_length=8192, verbose=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def builtin_server(tmp_path_factory):
    """``lmserve serve`` on the built-in model, room for 8 sequences, shared by the test files
    that use the official ``openai`` client on a real model."""
    log = str(tmp_path_factory.mktemp("builtin-server") / "server.log")
    with ServerProcess(["--max-num-sequence", "8"], log) as proc:
        yield proc


@pytest.fixture(scope="session")
def builtin_client(builtin_server):
    """The official ``openai`` client on ``builtin_server``."""
    with builtin_server.openai_client() as c:
        yield c


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama saved as a Hugging Face directory (loads in a fraction of a second)."""
    return make_hf_llama(str(tmp_path_factory.mktemp("tiny") / "model"), num_layers=2, seed=3)


@pytest.fixture(scope="session")
def hf_builtin():
    """transformers' own float32 model from the built-in GGUF: the reference."""
    from transformers import AutoModelForCausalLM

    path = builtin_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Wait until the engine thread has processed every request and abort."""
    deadline = time.monotonic() + timeout
    while not engine.is_idle():
        if time.monotonic() > deadline:
            raise AssertionError("engine still busy after %.0f s" % timeout)
        time.sleep(0.01)


def generate_tokens(engine: Engine, prompt: list[int], params, request_id=None) -> list[int]:
    """Every token id one request generates (all choices, in arrival order)."""
    return [t for out in engine.generate(prompt, params, request_id=request_id)
            for d in out.deltas for t in d.token_ids]


def plain_outputs(model_dir: str, requests: list[tuple[list[int], Any]], **config) -> list[list[int]]:
    """The tokens each ``(prompt, params)`` generates, one at a time, on an engine of
    ``model_dir`` without speculation (batch 4, quiet, and ``config``): the reference a drafter's
    output must match."""
    engine = Engine(model=model_dir, max_num_sequence=4, verbose=False, **config)
    try:
        return [generate_tokens(engine, prompt, params) for prompt, params in requests]
    finally:
        engine.shutdown()


def concurrently(fn, items: list, delays=None) -> list:
    """``fn(item)`` for every item, each from its own thread, all released together (each after
    its optional delay in seconds), and the results in order."""
    results: list = [None] * len(items)
    start = threading.Barrier(len(items))

    def worker(i):
        start.wait()
        if delays:
            time.sleep(delays[i])
        results[i] = fn(items[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def run_concurrently(engine: Engine, prompts, params, delays=None) -> list[list[int]]:
    """Send every prompt from its own thread, all released together (each after its optional
    delay in seconds); return each request's tokens."""
    return concurrently(lambda p: generate_tokens(engine, p, params), prompts, delays)


def churn_with_aborts(engine: AsyncEngine, n: int) -> None:
    """``n`` requests of random prompts, lengths (0 too), sampling, ``n`` and prompt scoring,
    arriving over 0.2 s, a third of them aborted after 0, 1 or 3 outputs (by leaving the
    stream); waits until the engine is idle and checks that every request was answered and
    none is left."""
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size

    async def one(i: int) -> int:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(0, 30),
                                n=rng.choice([1, 1, 2]), seed=i,
                                prompt_logprobs=rng.choice([None, None, None, 1]))
        abort_after = rng.choice([None, None, 0, 1, 3])
        await asyncio.sleep(rng.random() * 0.2)
        seen = 0
        async for _ in engine.generate(prompt, params):
            seen += 1
            if abort_after is not None and seen > abort_after:
                break  # leaving the iterator aborts the request
        return seen

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))

    counts = asyncio.run(main())
    assert len(counts) == n and all(c >= 1 for c in counts)
    wait_idle(engine)
    assert not engine._core.requests


def sixth_token_draws(engine: Engine, prompt: list[int], rounds: int = 50) -> list[int]:
    """The sixth token of 8 unseeded choices (temperature 1, top-k 8) per round: a draw of a
    token that a drafter drafted in most steps."""
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=6, n=8, ignore_eos=True)

    def draws(_) -> list[int]:
        deltas = [d for o in engine.generate(prompt, params) for d in o.deltas]
        return [[t for d in deltas if d.index == i for t in d.token_ids][5] for i in range(8)]

    # All rounds at once: as many run together as the engine's batch holds.
    return [t for round_ in concurrently(draws, list(range(rounds))) for t in round_]


def homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    """A chi-square test of homogeneity: the p-value that draws ``a`` and ``b`` come from one
    distribution."""
    from scipy.stats import chi2_contingency

    support = sorted(set(a) | set(b))
    assert len(support) > 2  # a distribution, not a certainty
    return chi2_contingency([[a.count(t) for t in support], [b.count(t) for t in support]]).pvalue


def assert_drafts_keep_the_distribution(model_dir: str, **speculation) -> None:
    """Unseeded draws of a drafted token with ``speculation`` (EngineConfig fields) follow the
    model's distribution at O0: a chi-square test of homogeneity against speculation off over
    400 draws each, at 0.1%; some drafts are accepted and some rejected."""
    prompt = list(range(300, 320))
    draws, counts = [], None
    for extra in ({}, speculation):
        engine = Engine(model=model_dir, opt="O0", max_num_sequence=32, verbose=False, **extra)
        try:
            draws.append(sixth_token_draws(engine, prompt))
            stats = engine.stats()
            counts = (stats.spec_num_accepted_tokens, stats.spec_num_draft_tokens)
        finally:
            engine.shutdown()
    assert 0 < counts[0] < counts[1]
    assert homogeneity_pvalue(*draws) > 0.001


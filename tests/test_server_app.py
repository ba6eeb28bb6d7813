"""The server app in-process (``create_app`` over a tiny engine, through httpx's ASGI transport):
engine failures, and the small parts (admission gate, settings, the ``serve`` flags)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import wait_idle
from lmserve import AsyncEngine
from lmserve.cli import build_parser
from lmserve.frontend.server.admission import AdmissionGate, Weight
from lmserve.frontend.server.app import create_app
from lmserve.frontend.server.errors import APIError
from lmserve.frontend.server.settings import ServerSettings

FAIL_AT_ONCE, FAIL_LATER = 13, 14  # seeds that make the engine fail a request (see flaky_engine)


@pytest.fixture(scope="module")
def flaky_engine(tiny_model_dir):
    """A tiny engine whose output processing raises for requests with the seeds above."""
    engine = AsyncEngine(tiny_model_dir, max_num_sequence=4, verbose=False)
    processor = engine._core.outputs
    real_append = processor.append

    def flaky(seq, token_id, logprob):
        seed = seq.request.params.seed
        if seed == FAIL_AT_ONCE or (seed == FAIL_LATER and seq.num_output_tokens >= 3):
            raise RuntimeError("injected fault")
        return real_append(seq, token_id, logprob)

    processor.append = flaky
    yield engine
    engine.shutdown()


def call(engine, requests):
    """Send ``(path, body)`` requests concurrently to a fresh app; returns the responses."""
    app = create_app(engine, ServerSettings(served_model_name="tiny"))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await asyncio.gather(*(client.post(path, json=body) for path, body in requests))

    return asyncio.run(main())


def test_an_engine_failure_fails_only_its_request(flaky_engine):
    body = {"prompt": "hi", "max_tokens": 6, "ignore_eos": True, "temperature": 1.0}
    fail_whole, fail_stream_early, fail_stream_late, good = call(flaky_engine, [
        ("/v1/completions", {**body, "seed": FAIL_AT_ONCE}),
        ("/v1/completions", {**body, "seed": FAIL_AT_ONCE, "stream": True}),
        ("/v1/completions", {**body, "seed": FAIL_LATER, "stream": True}),
        ("/v1/completions", {**body, "seed": 1}),
    ])
    for r in (fail_whole, fail_stream_early):  # nothing sent yet: a real status
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "injected" in r.json()["error"]["message"]
    # Failing after the stream started: one error event, then [DONE].
    assert fail_stream_late.status_code == 200
    events = [e.removeprefix("data: ") for e in fail_stream_late.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and "injected" in json.loads(events[-2])["error"]["message"]
    assert all("choices" in json.loads(e) for e in events[:-2]) and len(events) > 2
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 6
    wait_idle(flaky_engine)
    assert flaky_engine.kv_pages_in_use() == 0


def test_a_request_the_stopped_engine_cannot_run_gets_503_not_a_logged_failure(tiny_model_dir, caplog):
    engine = AsyncEngine(tiny_model_dir, max_num_sequence=2, verbose=False)
    engine.shutdown()  # as the server's shutdown does once its drain ends
    whole, stream = call(engine, [("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                                  ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True})])
    for r in (whole, stream):
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert "shut down" in r.json()["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info]  # expected: no traceback in the log


def test_metrics_count_engine_failures(flaky_engine):
    app = create_app(flaky_engine)
    metrics = app.state.lmserve.metrics

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "seed": FAIL_AT_ONCE})
            return (await client.get("/metrics")).text

    text = asyncio.run(main())
    assert 'lmserve:request_success_total{finished_reason="error"} 1.0' in text
    assert metrics.registry is not create_app(flaky_engine).state.lmserve.metrics.registry


def test_admission_gate_weighs_requests_by_sequences_and_tokens_and_drains():
    gate = AdmissionGate(max_sequences=4, max_tokens=100)
    big, small = Weight(sequences=3, tokens=10), Weight(sequences=1, tokens=10)
    gate.enter(big)
    with pytest.raises(APIError) as full:
        gate.enter(Weight(sequences=2, tokens=1))  # 5 sequences
    assert full.value.status == 429 and "4 sequences in flight (3 now, this request 2)" in full.value.message
    with pytest.raises(APIError) as full:
        gate.enter(Weight(sequences=1, tokens=91))  # 101 tokens
    assert full.value.status == 429 and "100 prompt tokens" in full.value.message
    gate.enter(small)
    gate.leave(big)
    gate.leave(small)
    assert (gate.in_flight, gate.sequences, gate.tokens) == (0, 0, 0)
    alone = Weight(sequences=1, tokens=1000)
    gate.enter(alone)  # more tokens than the bound, but alone: admitted
    gate.start_draining(grace=60)
    with pytest.raises(APIError) as closed:
        gate.enter(small)
    assert closed.value.status == 503
    assert not gate.drained()
    gate.leave(alone)
    assert gate.drained()
    late = AdmissionGate(max_sequences=1, max_tokens=1)
    late.enter(small)
    late.start_draining(grace=0)
    assert late.drained()  # the grace period is over even though a request still runs
    later = AdmissionGate(max_sequences=1, max_tokens=1)
    later.enter(small)
    later.start_draining(grace=60)
    later.stop_waiting()  # a second signal
    assert later.drained()


@pytest.mark.parametrize("change", [dict(port=70000), dict(max_body_bytes=0), dict(max_waiting=0),
                                    dict(shutdown_grace=-1), dict(api_key=""), dict(max_waiting_tokens=0),
                                    dict(max_seqs_per_request=0), dict(max_stop_chars=0),
                                    dict(header_timeout=0), dict(body_timeout=-1),
                                    dict(keep_alive_timeout=float("nan"))])
def test_settings_refuse_bad_values(change):
    with pytest.raises(ValueError):
        ServerSettings(**change)


def test_serve_flags():
    args = build_parser().parse_args(["serve", "--model", "m", "--port", "9000", "--api-key", "k",
                                      "--max-waiting", "3", "--served-model-name", "n",
                                      "--shutdown-grace", "2.5", "--max-num-sequence", "8",
                                      "--max-waiting-tokens", "900", "--max-seqs-per-request", "5",
                                      "--max-stop-chars", "7", "--header-timeout", "1.5",
                                      "--body-timeout", "2", "--keep-alive-timeout", "3"])
    assert (args.host, args.port, args.api_key, args.max_waiting) == ("127.0.0.1", 9000, "k", 3)
    assert (args.max_waiting_tokens, args.max_seqs_per_request, args.max_stop_chars) == (900, 5, 7)
    assert (args.header_timeout, args.body_timeout, args.keep_alive_timeout) == (1.5, 2, 3)
    assert (args.served_model_name, args.shutdown_grace, args.max_num_sequence) == ("n", 2.5, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "x"])


def test_offload_runs_at_most_its_slots_and_a_cancelled_caller_keeps_its_slot_until_done():
    import threading

    from lmserve.frontend.server.offload import Offload

    async def main():
        offload = Offload(slots=2)
        running, peak, lock, release = 0, 0, threading.Lock(), threading.Event()

        def work():
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
            release.wait(10)
            with lock:
                running -= 1
            return 1

        tasks = [asyncio.ensure_future(offload.run(work)) for _ in range(5)]
        await asyncio.sleep(0.2)
        assert running == 2
        for task in tasks[:2]:  # their clients left; the threads cannot be stopped
            task.cancel()
        await asyncio.sleep(0.2)
        assert running == 2  # so no third thread starts until they are done
        release.set()
        assert await asyncio.gather(*tasks[2:]) == [1, 1, 1]
        assert peak == 2

    asyncio.run(main())

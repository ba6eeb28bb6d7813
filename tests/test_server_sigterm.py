"""SIGTERM drains ``lmserve serve``: new requests get 503, a running stream completes, exit 0."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from server_process import ServerProcess


def data_events(stream: httpx.Response) -> Iterator[str]:
    """The payloads of a server-sent event stream, as they come."""
    return (line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: "))


def test_sigterm_lets_the_running_stream_finish_then_exits_0(tiny_model_dir, tmp_path):
    server = ServerProcess(["--model", tiny_model_dir, "--served-model-name", "tiny",
                            "--shutdown-grace", "60"], str(tmp_path / "server.log")).start()
    try:
        body = {"model": "tiny", "prompt": "a long story", "max_tokens": 400, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=server.base_url, timeout=60.0) as client, \
                client.stream("POST", "/v1/completions", json=body) as stream:
            events = data_events(stream)
            seen = [next(events)]
            server.signal(signal.SIGTERM)
            # Draining: still listening, but nothing new is admitted.
            with httpx.Client(base_url=server.base_url, timeout=10.0) as other:
                refused = other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                health = other.get("/health")
            seen += list(events)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert health.status_code == 503
        assert seen[-1] == "[DONE]"
        assert json.loads(seen[-2])["usage"]["completion_tokens"] == 400
        assert server.wait(timeout=30) == 0, server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("grace, signals", [(0.5, 1), (120, 2)])
def test_requests_past_the_grace_period_or_a_second_signal_end_with_an_error_then_exit_0(
        tiny_model_dir, tmp_path, grace, signals):
    # A second signal skips the rest of the grace period. It made the process exit 143 (killed
    # by the signal uvicorn re-raised at exit) before.
    server = ServerProcess(["--model", tiny_model_dir, "--shutdown-grace", str(grace)],
                           str(tmp_path / "server.log")).start()
    try:
        body = {"prompt": "endless", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=60.0) as client, \
                client.stream("POST", "/v1/completions", json=body) as stream:
            events = data_events(stream)
            seen = [next(events)]
            server.signal(signal.SIGTERM)
            if signals == 2:
                # Once the first is handled (two signals pending at once are delivered as one).
                while httpx.get(server.base_url + "/health").status_code != 503:
                    time.sleep(0.01)
                seen.append(next(events))  # still streaming: draining
                server.signal(signal.SIGTERM)
            seen += list(events)
        assert seen[-1] == "[DONE]"
        error = json.loads(seen[-2])["error"]
        assert "shut down" in error["message"] and error["code"] == "server_shutting_down"
        assert server.wait(timeout=20) == 0, server.log()
        assert "Traceback" not in server.log()  # an expected end, not a server failure
    finally:
        server.stop()


def test_a_signal_after_the_server_has_stopped_does_not_kill_the_process(tiny_model_dir, tmp_path):
    # uvicorn puts back the handlers it found when it stops; a second SIGTERM then killed the
    # process on its way out (status -15 / 143 after a clean drain).
    server = ServerProcess(["--model", tiny_model_dir], str(tmp_path / "server.log")).start()
    try:
        server.signal(signal.SIGTERM)  # nothing in flight: the drain ends at once
        time.sleep(0.5)
        server.signal(signal.SIGTERM)
        assert server.wait(timeout=20) == 0, server.log()
    finally:
        server.stop()

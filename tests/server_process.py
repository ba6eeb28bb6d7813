"""``lmserve serve`` as a real process for tests: started on a free loopback port, ready once
/health answers, stopped (SIGTERM, then SIGKILL) at the end. Its log goes to a file, so a full
pipe can never block the server, and is shown when it fails to start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Optional

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process; use as a context manager or call ``start`` / ``stop``."""

    def __init__(self, args: list[str], log_path: str, hide_modules: Sequence[str] = ()) -> None:
        """``args`` follow ``lmserve serve`` (``--port`` is added here). ``hide_modules``: packages
        the server cannot import, as on an install without them."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        run = ["-m", "lmserve.cli"]
        if hide_modules:  # None in sys.modules makes an import fail
            hide = "".join(f"sys.modules[{name!r}] = None; " for name in hide_modules)
            run = ["-c", f"import sys; {hide}from lmserve.cli import main; sys.exit(main(sys.argv[1:]))"]
        self._args = [sys.executable, *run, "serve", "--port", str(self.port), "--log-level", "warning",
                      *args]
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 90.0) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{self.log()}")

    def openai_client(self) -> openai.OpenAI:
        """The official client on this server (no retries: a test sees the first answer)."""
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0)

    def tokenize(self, **body: object) -> list[int]:
        """The token ids ``/tokenize`` gives for ``body`` (a prompt or messages)."""
        r = httpx.post(self.base_url + "/tokenize", json=body, timeout=30.0)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-5000:]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 15.0) -> Optional[int]:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in Prometheus text, or of the sum of its
    labelled samples."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((name + " ", name + "{"))]
    if not values:
        raise KeyError(name)
    return sum(values)


def wait_until_idle(base_url: str, timeout: float = 20.0) -> str:
    """Poll /metrics until no request runs or waits and no KV page is used; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base_url + "/metrics", timeout=5.0).text
        busy = [n for n in ("lmserve:num_requests_running", "lmserve:num_requests_waiting",
                            "lmserve:kv_cache_usage_perc") if metric(text, n) != 0]
        if not busy:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout} s: {busy}\n{text}")
        time.sleep(0.1)

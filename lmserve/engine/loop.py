"""The engine thread: owns the EngineCore, takes commands from callers, delivers outputs to sinks.

Callers never touch the core. They post commands (add, abort) on a queue and receive each
request's outputs through a sink callback, called on the engine thread: a sink must only hand
the output over (put it on a queue), never block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Union

from lmserve.engine.core import EngineCore
from lmserve.outputs import RequestOutput
from lmserve.sampling_params import SamplingParams

logger = logging.getLogger("lmserve")

Sink = Callable[[Union[RequestOutput, BaseException]], None]
STATS_INTERVAL_S = 10.0


class EngineLoop:
    """Runs ``core.step()`` on a background thread for as long as there is work."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopped = False
        self._pending = 0  # commands posted and not yet handled
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lmserve-engine", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: Sink) -> None:
        """Validate in the caller's thread (errors raise here), then queue the request."""
        self.core.validate(prompt_token_ids, params)
        self._post(("add", request_id, prompt_token_ids, params, sink))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def is_idle(self) -> bool:
        """No command waiting to be handled and no request in the engine."""
        with self._pending_lock:
            return self._pending == 0 and not self.core.has_work()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._post(("wake",))
        self._thread.join(timeout)

    def _post(self, cmd: tuple) -> None:
        with self._pending_lock:
            self._pending += 1
        self._commands.put(cmd)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        last_log = time.monotonic()
        logged = (0, 0)
        while not self._stopped:
            # Block only when idle, so a busy engine never waits on its callers.
            self._handle(self._commands.get() if not self.core.has_work() else None)
            while not self._commands.empty():
                self._handle(self._commands.get_nowait())
            try:
                outputs = self.core.step()
            except Exception as exc:  # a bug in a step fails its requests, not the engine
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)
            now = time.monotonic()
            if self.core.config.verbose and now - last_log >= STATS_INTERVAL_S:
                logged = self._log_stats(now - last_log, logged)
                last_log = now
        self._fail_all(RuntimeError("the engine was shut down"))

    def _handle(self, cmd) -> None:
        if cmd is None:
            return
        try:
            self._handle_command(cmd)
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _handle_command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request_id, prompt, params, sink = cmd
            try:
                self.core.add_request(request_id, prompt, params)
            except Exception as exc:
                sink(exc)
                return
            self._sinks[request_id] = sink
        elif cmd[0] == "abort":
            out = self.core.abort_request(cmd[1])
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
        if sink is not None:
            sink(out.error if out.error is not None else out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.core.requests):
            self.core.abort_request(request_id)
        for sink in self._sinks.values():
            sink(exc)
        self._sinks.clear()

    def _log_stats(self, elapsed: float, logged: tuple[int, int]) -> tuple[int, int]:
        st = self.core.stats()
        prefill, decode = st.prefill_tokens - logged[0], st.decode_tokens - logged[1]
        logger.info(
            "running %d, waiting %d, KV pages %d/%d used, prefill %.1f tok/s, decode %.1f tok/s, "
            "preemptions %d",
            st.num_running, st.num_waiting, st.kv_pages_used, st.kv_pages_total,
            prefill / elapsed, decode / elapsed, st.num_preemptions,
        )
        return st.prefill_tokens, st.decode_tokens

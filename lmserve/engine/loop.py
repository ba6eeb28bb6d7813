"""The engine thread: owns the EngineCore, takes commands from callers, delivers outputs to sinks.

Callers never touch the core. They post commands (add, abort, call) on a queue and receive each
request's outputs through a sink callback, called on the engine thread: a sink must only hand
the output over (put it on a queue), never block. Anything that reads the core's state (stats,
pages in use) runs on the engine thread too, between steps, through ``call``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

from lmserve.engine.core import EngineCore
from lmserve.engine.thread_check import ThreadSyncCheck
from lmserve.errors import InvalidRequestError
from lmserve.outputs import RequestOutput
from lmserve.parallel.group import ParallelFailure
from lmserve.sampling_params import SamplingParams

logger = logging.getLogger("lmserve")

Sink = Callable[[Union[RequestOutput, BaseException]], None]
STATS_INTERVAL_S = 10.0
RELEASE_INTERVAL_S = 1.0  # how often idle KV pages are looked for, busy or not
_T = TypeVar("_T")


class EngineShutDown(RuntimeError):
    """The engine was shut down before the request finished, or before it was submitted."""


# The commands callers post to the engine thread.


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: wakes a parked thread to see that the loop has stopped."""


_Command = Union[_Add, _Abort, _Call, _Wake]


def _malloc_trim() -> Callable[[], None]:
    try:
        libc_trim = ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError):
        return lambda: None
    return lambda: libc_trim(0)


# Give the free memory of the C heap back to the system. A large step's activations and logits
# (128 sequences: tens of MiB each) are freed after it, but glibc keeps most of such memory
# mapped for reuse: after a burst the resident memory stayed 150 MiB above its level before.
trim_heap = _malloc_trim()


class EngineLoop:
    """Builds the EngineCore and runs ``core.step()`` on one background thread.

    The core is built on that thread too, so one thread runs every torch and kernel call of the
    engine: OpenMP keeps a pool of worker threads per calling thread, and a second pool would
    leave more workers than cores, which makes libgomp put idle workers to sleep at once and pay
    a wake-up at every parallel region (measured: a decode step 60% slower).
    """

    def __init__(self, make_core: Callable[[], EngineCore]) -> None:
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopped = False
        self._lock = threading.Lock()  # guards the three fields below
        self._pending = 0  # commands posted and not yet handled
        self._request_ids: set[str] = set()  # submitted and not yet finished
        self._parked = True  # the thread waits for a command with no work at all
        # What stopped the engine for good (a parallel engine that lost a rank), or None.
        self.failure: Optional[BaseException] = None
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(make_core, built),
                                        name="lmserve-engine", daemon=True)
        self._thread.start()
        self.core: EngineCore = built.result()  # re-raises what building the core raised

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: Sink) -> None:
        """Validate in the caller's thread (errors raise here), then queue the request."""
        self.core.validate(prompt_token_ids, params)
        with self._lock:
            if request_id in self._request_ids:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if not self._post(_Add(request_id, prompt_token_ids, params, sink)):
                raise self._stopped_error()
            self._request_ids.add(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._post(_Abort(request_id))

    def call(self, fn: Callable[[], _T], timeout: float = 60.0) -> _T:
        """Run ``fn`` on the engine thread between two steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            posted = self._post(_Call(fn, future))
        if not posted:
            self._thread.join()  # once it has stopped, nothing else touches the core
            return fn()
        return future.result(timeout)

    def is_idle(self) -> bool:
        """No command waiting to be handled and no request in the engine."""
        with self._lock:
            return self._pending == 0 and self._parked

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._post(_Wake())
            self._stopped = True
        self._thread.join(timeout)

    def _stopped_error(self) -> Exception:
        """What a request meets once the engine has stopped: shut down, or failed for good."""
        if self.failure is None:
            return EngineShutDown("the engine was shut down")
        return RuntimeError(f"the engine stopped after a failure: {self.failure}")

    def _post(self, cmd: _Command) -> bool:
        """Queue a command (the caller holds ``_lock``); False once the engine is shut down, so
        nothing is queued after the thread's last look at the queue."""
        if self._stopped:
            return False
        self._pending += 1
        self._commands.put(cmd)
        return True

    # -- the thread ----------------------------------------------------------------------------

    def _run(self, make_core: Callable[[], EngineCore], built: concurrent.futures.Future) -> None:
        try:
            self.core = make_core()
            self._sync_check = ThreadSyncCheck()  # (builds its probe now, not in a step)
        except BaseException as exc:  # noqa: BLE001  (handed to the constructor, which raises it)
            self._stopped = True
            built.set_exception(exc)
            return
        built.set_result(self.core)
        try:
            self._serve()
        except Exception as exc:  # a lost rank, or a bug outside a step: no step can run any more
            if isinstance(exc, ParallelFailure):
                logger.error("engine stopped: %s", exc)
            else:
                logger.exception("engine stopped")
            self.failure = exc
            with self._lock:
                self._stopped = True
        finally:
            self._fail_all(self.failure or self._stopped_error())
            with self._lock:
                self._parked = True
            self.core.close(kill=self.failure is not None)

    def _serve(self) -> None:
        last_log = last_release = time.monotonic()
        logged = (0, 0)
        while not self._stopped:
            if not self.core.has_work():  # block only when idle: a busy engine never waits
                with self._lock:
                    self._parked = self._pending == 0
                cmd = self._wait_for_command()
                with self._lock:
                    self._parked = False  # before the command is handled and counted as done
                self._handle(cmd)
            while not self._commands.empty():
                self._handle(self._commands.get_nowait())
            try:
                outputs = self.core.step()
            except ParallelFailure:
                raise
            except Exception as exc:  # a bug in a step fails its requests, not the engine
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)
            now = time.monotonic()
            if now - last_release >= RELEASE_INTERVAL_S:
                self.core.release_idle_memory()
                last_release = now
            self._sync_check.maybe_check(now)
            if self.core.config.verbose and now - last_log >= STATS_INTERVAL_S:
                logged = self._log_stats(now - last_log, logged)
                last_log = now

    def _wait_for_command(self) -> _Command:
        """The next command; while none comes, idle KV pages give their memory back, and once
        they all have, so does the C heap (once per idle spell)."""
        trimmed = False
        while True:
            try:
                return self._commands.get(timeout=RELEASE_INTERVAL_S)
            except queue.Empty:
                self.core.release_idle_memory()
                if not trimmed and self.core.pool.num_unreleased == 0:
                    trim_heap()
                    trimmed = True

    def _handle(self, cmd: _Command) -> None:
        try:
            self._handle_command(cmd)
        finally:
            with self._lock:
                self._pending -= 1

    def _handle_command(self, cmd: _Command) -> None:
        if isinstance(cmd, _Add):
            try:
                if self._stopped:
                    raise self._stopped_error()
                self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
            except Exception as exc:
                self._forget(cmd.request_id)
                cmd.sink(exc)
                return
            self._sinks[cmd.request_id] = cmd.sink
        elif isinstance(cmd, _Abort):
            out = self.core.abort_request(cmd.request_id)
            if out is not None:
                self._deliver(out)
        elif isinstance(cmd, _Call):
            try:
                cmd.future.set_result(cmd.fn())
            except Exception as exc:
                cmd.future.set_exception(exc)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            sink = self._sinks.pop(out.request_id, None)
            self._forget(out.request_id)
        else:
            sink = self._sinks.get(out.request_id)
        if sink is not None:
            sink(out.error if out.error is not None else out)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._request_ids.discard(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request in the engine, and (once stopped) every command still queued."""
        for request_id in list(self.core.requests):
            self.core.abort_request(request_id)
        for request_id, sink in list(self._sinks.items()):
            self._forget(request_id)
            sink(exc)
        self._sinks.clear()
        if self._stopped:
            while not self._commands.empty():
                self._handle(self._commands.get_nowait())  # adds are refused, calls answered

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

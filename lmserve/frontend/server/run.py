"""``serve``: run the app on uvicorn until a signal, then drain it and stop."""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType
from typing import Optional

import uvicorn

from lmserve.engine.async_engine import AsyncEngine
from lmserve.frontend.server.admission import AdmissionGate
from lmserve.frontend.server.app import create_app
from lmserve.frontend.server.header_timeout import HeaderTimeoutProtocol
from lmserve.frontend.server.settings import ServerSettings
from lmserve.structured.xgrammar_lib import describe_structured_output, xgrammar_installed

logger = logging.getLogger("lmserve")

# After the drain, how long uvicorn lets open connections finish before cancelling them. The
# engine has failed what still ran by then, so they end at once; this is only a backstop.
_CLOSE_TIMEOUT_S = 1.0


class _DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before its own graceful shutdown.

    The first SIGTERM or SIGINT does not close the listening socket: new requests keep getting
    an answer (503) while admitted ones run to their end, for up to the grace period. Then
    the engine stops (failing what still runs) and uvicorn shuts down as usual. A second signal
    skips the wait, a third the wait for open connections. Every way ends in exit status 0:
    uvicorn's own handler would re-raise the signal at exit, and the process would die by it
    (status 143 for SIGTERM) after a clean stop.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, gate: AdmissionGate,
                 grace: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._gate = gate
        self._grace = grace
        self.failed = False  # the engine failed for good: exit with status 1

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(sig).name
        if not self._gate.draining:
            logger.info("%s: draining %d request(s), for up to %g s; again to stop now",
                        name, self._gate.in_flight, self._grace)
            self._gate.start_draining(self._grace)
        elif not self._gate.drained():
            logger.info("%s: stopping without waiting for the %d request(s) still running",
                        name, self._gate.in_flight)
            self._gate.stop_waiting()
        else:  # already shutting down
            logger.info("%s: closing the open connections now", name)
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._engine.failure is not None and not self.failed:
            logger.error("the engine has failed (%s); the server stops", self._engine.failure)
            self.failed = True
        return await super().on_tick(counter) or self._gate.drained() or self.failed

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        # Stopping the engine first fails the requests still running past the grace period, so
        # that they end properly (a 500, or a stream's error event and [DONE]) before uvicorn
        # closes the connections; and the event loop is still there to take the last outputs.
        self._engine.shutdown()
        await super().shutdown(sockets)


def serve(engine: AsyncEngine, settings: ServerSettings, log_level: str = "info") -> None:
    """Serve ``engine`` at ``settings.host:settings.port`` until a signal has drained the server.

    Returns normally after a drain, with the engine shut down. Exits with status 1 (uvicorn's
    ``SystemExit``) when the address cannot be bound, and when the engine fails for good (a
    parallel engine that lost a rank), within a second of the failure.
    """
    app = create_app(engine, settings)
    if not xgrammar_installed():
        logger.warning("structured output is %s", describe_structured_output())
    # uvicorn annotates both timeouts int, and takes them as asyncio's seconds: a float works
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=_CLOSE_TIMEOUT_S,  # type: ignore[arg-type]
                            timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
                            http=HeaderTimeoutProtocol.with_header_timeout(settings.header_timeout))
    server = _DrainingServer(config, engine, app.state.lmserve.gate, settings.shutdown_grace)
    server.run()
    if server.failed:
        raise SystemExit(1)

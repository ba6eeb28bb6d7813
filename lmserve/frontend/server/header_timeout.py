"""uvicorn's HTTP/1.1 protocol with a deadline on a request's headers.

uvicorn closes a connection idle after an answer (``timeout_keep_alive``), but not one that
never sends a complete request: a client that connects and sends nothing, or its headers a byte
at a time, held a connection (and a file descriptor) forever. Here a connection must finish
each request's headers within ``header_timeout`` seconds of opening, or of its previous answer.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutProtocol(H11Protocol):
    """``H11Protocol`` closing connections whose request headers do not arrive in time."""

    header_timeout = 10.0  # seconds; set per server by ``with_header_timeout``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._timed_cycle: Any = None  # the request whose headers have arrived last

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[HeaderTimeoutProtocol]:
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._timed_cycle:  # a request's headers are in: it is under way
            self._timed_cycle = self.cycle
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before uvicorn starts on a pipelined request, which disarms it again
        super().on_response_complete()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

"""The server's routes, one module per group; ``api_access`` guards the API ones."""

from __future__ import annotations

from fastapi import Request

from lmserve.frontend.server.auth import check_api_key
from lmserve.frontend.server.state import server_state


async def api_access(request: Request) -> None:
    """Dependency of the API routes: 503 while the server drains, 401 without the right key."""
    state = server_state(request)
    state.gate.check_open()
    if state.settings.api_key is not None:
        check_api_key(request, state.settings.api_key)


# Last: the route modules import api_access from here.
from lmserve.frontend.server.routes import generate, models, ops, tokenize  # noqa: E402

ROUTE_MODULES = (generate, models, tokenize, ops)

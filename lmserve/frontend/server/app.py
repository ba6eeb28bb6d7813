"""``create_app``: the FastAPI application over one ``AsyncEngine``."""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI

from lmserve import __version__
from lmserve.engine.async_engine import AsyncEngine
from lmserve.frontend.server.errors import install_error_handlers
from lmserve.frontend.server.openapi import openapi_document
from lmserve.frontend.server.routes import ROUTE_MODULES
from lmserve.frontend.server.settings import ServerSettings
from lmserve.frontend.server.state import ServerState


def create_app(engine: AsyncEngine, settings: Optional[ServerSettings] = None) -> FastAPI:
    """An app serving ``engine`` over OpenAI's HTTP API (routes: see docs/server.md).

    The app never shuts the engine down: whoever made the engine owns it. Its shared state is
    ``app.state.lmserve`` (a ``ServerState``).
    """
    # /openapi.json is built from the request and response models (server/openapi.py); no
    # interactive docs, which would load their scripts from the internet.
    app = FastAPI(title="lmserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.lmserve = ServerState.build(engine, settings or ServerSettings())
    install_error_handlers(app)
    for module in ROUTE_MODULES:
        app.include_router(module.router)
    document = openapi_document()
    app.openapi = lambda: document  # type: ignore[method-assign]
    return app

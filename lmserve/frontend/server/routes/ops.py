"""``GET /health`` and ``GET /metrics``: for load balancers and Prometheus, open without a key."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from lmserve.frontend.server.errors import APIError
from lmserve.frontend.server.state import server_state

router = APIRouter()


@router.head("/health", operation_id="health_head")
@router.get("/health", operation_id="health")
async def health(request: Request) -> Response:
    """200 while serving; 503 once shutdown has begun or the engine has failed for good (a
    parallel engine that lost a rank), so that traffic moves elsewhere."""
    state = server_state(request)
    state.gate.check_open()
    failure = state.model.engine.failure
    if failure is not None:
        raise APIError(503, f"the engine has failed: {failure}", code="engine_failed")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format; names are listed in docs/server.md.

    Rendered in a worker thread: the engine's gauges are read on the engine thread between two
    steps, which can take a while during a long prefill, and the event loop must not wait.
    """
    text = await run_in_threadpool(server_state(request).metrics.render)
    return Response(text, media_type=CONTENT_TYPE_LATEST)

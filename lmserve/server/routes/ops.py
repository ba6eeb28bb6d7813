"""``GET /health`` and ``GET /metrics``: for load balancers and Prometheus, open without a key."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from lmserve.server.state import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while serving; 503 once shutdown has begun, so that traffic moves elsewhere."""
    server_state(request).gate.check_open()
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format; names are listed in docs/server.md."""
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

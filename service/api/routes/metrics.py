"""``/metrics``: Prometheus text exposition."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from service.api.problems import problem_responses
from service.api.routes.deps import DaemonDep

router = APIRouter(tags=["metrics"], responses=problem_responses(401))


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus exposition"}},
)
async def metrics(daemon: DaemonDep) -> Response:
    text = await run_in_threadpool(daemon.metrics_exposition)  # takes the lock
    return Response(text, media_type=CONTENT_TYPE_LATEST)

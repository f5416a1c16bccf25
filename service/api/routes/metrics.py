"""``/metrics``: Prometheus text exposition."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.problems import problem_responses
from service.api.routes.deps import DaemonDep

router = APIRouter(tags=["metrics"], responses=problem_responses(401))


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus exposition"}},
)
def metrics(daemon: DaemonDep) -> Response:
    text = daemon.metrics_exposition()  # takes the lock: a plain function, in a worker thread
    return Response(text, media_type=CONTENT_TYPE_LATEST)

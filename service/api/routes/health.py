"""``/health`` and ``/ready``: open to everyone, never blocked by a load.

``/health`` answers on the event loop itself (it takes no lock and touches no file), so it
answers even while every worker thread is busy; ``/ready`` stats arena files, in a thread."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from protocol.schemas.health import Health, Readiness
from service.api.routes.deps import DaemonDep

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health, summary="Liveness, boot id and version")
async def health(daemon: DaemonDep) -> Health:
    return daemon.health()


@router.get(
    "/ready",
    response_model=Readiness,
    summary="Ready: a model held, none loading, none failed (failed ones allowed with "
    "--keep-going)",
    responses={
        503: {
            "model": Readiness,
            "description": "No model, a model still loading, or a model failed (`reason`)",
        }
    },
)
def ready(daemon: DaemonDep) -> JSONResponse:
    readiness = daemon.readiness()  # stats every arena file: a plain function, in a thread
    return JSONResponse(
        readiness.model_dump(mode="json"), status_code=200 if readiness.ready else 503
    )

"""What the routes share: their dependencies (async: FastAPI runs sync dependencies in a
thread pool, a hop per request that the lease path cannot afford), path parameters, the router
of routes that name their caller, and the empty answer of a removal."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response, status
from fastapi import Path as PathParam

from protocol.schemas.models import MODEL_ID_PATTERN
from service.api.auth import CALLER_KEY
from service.api.problems import problem_responses
from service.api.waits import Waits
from service.daemon import Daemon
from service.registry.lease_holders import Caller


async def get_daemon(request: Request) -> Daemon:
    daemon: Daemon = request.app.state.daemon
    return daemon


async def get_waits(request: Request) -> Waits:
    waits: Waits = request.app.state.waits
    return waits


DaemonDep = Annotated[Daemon, Depends(get_daemon)]
WaitsDep = Annotated[Waits, Depends(get_waits)]


async def get_caller(request: Request) -> Caller:
    """Who is calling, as the auth middleware proved it (it runs in front of every route that
    asks)."""
    caller: Caller = request.scope[CALLER_KEY]
    return caller


CallerDep = Annotated[Caller, Depends(get_caller)]


# A lease, parked engine or start-up slot ticket: ``<boot id>.<random>``.
REGISTRATION_ID_PATTERN = r"^[0-9a-f]{1,64}\.[0-9a-f]{1,64}$"
RegistrationId = Annotated[str, PathParam(pattern=REGISTRATION_ID_PATTERN)]
ModelId = Annotated[str, PathParam(pattern=MODEL_ID_PATTERN)]


def caller_router(prefix: str, tag: str) -> APIRouter:
    """A router whose every route names its caller, so each may answer 401 (no credentials),
    403 (not this caller's) and 422 (a malformed request)."""
    return APIRouter(prefix=prefix, tags=[tag], responses=problem_responses(401, 403, 422))


def no_content() -> Response:
    """The answer of a route that removes something: 204, no body."""
    return Response(status_code=status.HTTP_204_NO_CONTENT)

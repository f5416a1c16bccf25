"""``/v1/leases``: lend a model's arenas to an engine, renew, release.

The routes are plain functions, which FastAPI runs in its worker threads: they take the
daemon's lock, and a grant reads the client's ``/proc`` entry and stats the arena file. The
event loop waits on none of it (the hop costs about 0.1 ms)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Body, Response, status

from protocol.schemas.leases import LeaseGrant, LeaseInfo, LeaseRequest, RenewRequest
from service.api.problems import problem_responses
from service.api.routes.deps import CallerDep, DaemonDep, RegistrationId, caller_router, no_content

router = caller_router("/v1/leases", "leases")


@router.post(
    "",
    response_model=LeaseGrant,
    status_code=status.HTTP_201_CREATED,
    summary="Lease one TP rank of a model: its handles and full layout manifest",
    responses=problem_responses(404, 409, 429, 503),
)
def grant(body: LeaseRequest, daemon: DaemonDep, caller: CallerDep) -> Response:
    start = time.perf_counter()
    granted = daemon.desk.grant(body, caller)
    # Rendered from the layout JSON made at load time (the same bytes as LeaseGrant's).
    response = Response(
        granted.render(),
        status_code=status.HTTP_201_CREATED,
        media_type="application/json",
        headers={"Location": f"/v1/leases/{granted.lease.id}"},
    )
    daemon.observe_grant_seconds(time.perf_counter() - start)
    return response


@router.get("", response_model=list[LeaseInfo], summary="Active leases the caller may touch")
def list_leases(daemon: DaemonDep, caller: CallerDep) -> list[LeaseInfo]:
    return daemon.desk.list_leases(caller)


@router.get(
    "/{lease_id}",
    response_model=LeaseInfo,
    summary="One lease",
    responses=problem_responses(404, 409, 410),
)
def get_lease(lease_id: RegistrationId, daemon: DaemonDep, caller: CallerDep) -> LeaseInfo:
    return daemon.desk.lease(lease_id, caller)


@router.post(
    "/{lease_id}/renew",
    response_model=LeaseInfo,
    summary="Extend a lease",
    responses=problem_responses(404, 409, 410),
)
def renew(
    lease_id: RegistrationId,
    daemon: DaemonDep,
    caller: CallerDep,
    body: Annotated[RenewRequest | None, Body()] = None,
) -> LeaseInfo:
    return daemon.desk.renew(lease_id, body.ttl_s if body else None, caller)


@router.delete(
    "/{lease_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Release a lease",
    responses=problem_responses(404, 409, 410),
)
def release(lease_id: RegistrationId, daemon: DaemonDep, caller: CallerDep) -> Response:
    daemon.desk.release(lease_id, caller)
    return no_content()

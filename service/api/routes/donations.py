"""``/v1/donations``: an engine gives the daemon its rank as vLLM's processing left it.

The routes are plain functions, which FastAPI runs in its worker threads: an offer creates a
shared-memory file and reads the donor's ``/proc`` entry, a commit reads every donated byte to
check its checksum."""

from __future__ import annotations

from fastapi import Response, status

from protocol.schemas.donations import (
    DonationAbandon,
    DonationCommit,
    DonationInfo,
    DonationOffer,
    DonationRequest,
)
from protocol.schemas.models import ModelInfo
from service.api.problems import problem_responses
from service.api.routes.deps import CallerDep, DaemonDep, ModelId, caller_router, no_content

router = caller_router("/v1/donations", "donations")


@router.get("", response_model=list[DonationInfo], summary="Donated models, pending or held")
def list_donations(daemon: DaemonDep) -> list[DonationInfo]:
    return daemon.donations.infos()


@router.post(
    "",
    response_model=DonationOffer,
    status_code=status.HTTP_201_CREATED,
    summary="Ask for an arena to donate one rank's processed tensors into",
    responses=problem_responses(409, 429, 507),
)
def offer(body: DonationRequest, daemon: DaemonDep, caller: CallerDep) -> DonationOffer:
    return daemon.donations.offer(body, caller)


@router.post(
    "/{model_id}/commit",
    response_model=ModelInfo,
    summary="Publish a donation once its tensors are written (each checked by its checksum)",
    responses=problem_responses(404),
)
def commit(
    model_id: ModelId, body: DonationCommit, daemon: DaemonDep, caller: CallerDep
) -> ModelInfo:
    return daemon.model_info(daemon.donations.commit(model_id, body, caller))


@router.post(
    "/{model_id}/abandon",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Give up a pending donation and its arena",
    responses=problem_responses(404),
)
def abandon(
    model_id: ModelId, body: DonationAbandon, daemon: DaemonDep, caller: CallerDep
) -> Response:
    daemon.donations.abandon(model_id, body.secret, caller)
    return no_content()

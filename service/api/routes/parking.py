"""``/v1/parking``: engines started ahead of need wait here, at their load step, until the
daemon releases them (an engine on their model ended, or an operator asked).

An engine parks (``POST``), then asks for its registration with ``wait_s`` (a long-poll that
answers as soon as it is released or cancelled, and holds no worker thread meanwhile), and
withdraws it once it is done waiting (``DELETE``). Operators list parked engines, release one
(by id, or the oldest of a model: ``POST /v1/parking/models/{model}/release``) and cancel one;
an engine's TP ranks go together. A registration is its caller's: the process the kernel proved
is the one watched, and only its user or a trusted caller (the token, root, the daemon's user)
sees, releases, cancels or withdraws it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Query

from protocol.schemas.parking import ParkedEngine, ParkRequest, ParkState
from protocol.schemas.tensor_parallel import MAX_TP_SIZE
from service.api.problems import problem_responses
from service.api.routes.deps import (
    CallerDep,
    DaemonDep,
    ModelId,
    RegistrationId,
    caller_router,
)
from service.api.routes.registrations import RegistrationRoutes
from service.registry.lease_desk import LeaseDesk
from service.registry.lease_holders import Caller

router = caller_router("/v1/parking", "parking")


RegistrationRoutes(
    request=ParkRequest,
    model=ParkedEngine,
    id_name="parked_id",
    names=("park", "list_parked", "get_parked", "withdraw"),
    summaries=(
        "Park one TP rank of an engine until it is released",
        "Every parked engine (rank) the caller may touch",
        "One parked engine; with wait_s, answers once it is released or cancelled",
        "Withdraw a registration (the engine's own, once it is done waiting)",
    ),
    create_errors=(404, 429),
    wait_description="answer once released or cancelled, or after this",
    create=LeaseDesk.park,
    listed=LeaseDesk.parked,
    read=LeaseDesk.parked_engine,
    done=lambda entry: entry.state is not ParkState.parked,
    remove=LeaseDesk.withdraw,
).add_to(router)


@router.post(
    "/models/{model_id}/release",
    response_model=list[ParkedEngine],
    summary="Release the oldest engine parked (every rank) for a model",
    responses=problem_responses(409),
)
def release_oldest(
    model_id: ModelId,
    daemon: DaemonDep,
    caller: CallerDep,
    tp_size: Annotated[int | None, Query(ge=1, le=MAX_TP_SIZE, description="default: any")] = None,
) -> list[ParkedEngine]:
    return daemon.desk.release_oldest(model_id, tp_size, caller)


def _add_engine_action(
    verb: str, summary: str, act: Callable[[LeaseDesk, str, Caller], list[ParkedEngine]]
) -> None:
    """``POST /{parked_id}/<verb>``: an operator's ``act`` on one parked engine, every rank of
    it, answering those ranks."""

    @router.post(
        f"/{{parked_id}}/{verb}",
        name=verb,
        response_model=list[ParkedEngine],
        summary=summary,
        responses=problem_responses(404, 409),
    )
    def action(
        parked_id: RegistrationId, daemon: DaemonDep, caller: CallerDep
    ) -> list[ParkedEngine]:
        return act(daemon.desk, parked_id, caller)


_add_engine_action("release", "Release this engine (all its ranks)", LeaseDesk.release_parked)
_add_engine_action(
    "cancel",
    "Cancel this engine (all its ranks): it falls back or fails, per its options",
    LeaseDesk.cancel_parked,
)

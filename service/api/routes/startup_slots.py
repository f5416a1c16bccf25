"""``/v1/startup-slots``: engines that share a GPU size their memory one after another.

An engine asks for its GPU's slot (``POST``) just before vLLM takes its memory snapshot, waits
for it with ``wait_s`` (a long-poll that holds no worker thread), and gives it back
(``DELETE``) once its KV cache is allocated and its graphs captured. A ticket is its caller's,
as a parked engine is (``/v1/parking``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Response, status

from protocol.schemas.parking import MAX_WAIT_S
from protocol.schemas.startup_slots import SlotRequest, SlotState, SlotTicket
from service.api.problems import problem_responses
from service.api.routes.deps import (
    CallerDep,
    DaemonDep,
    RegistrationId,
    WaitsDep,
    caller_router,
    no_content,
)

router = caller_router("/v1/startup-slots", "startup-slots")
WaitS = Annotated[
    float, Query(ge=0, le=MAX_WAIT_S, description="answer once the slot is held, or after this")
]


@router.post(
    "",
    response_model=SlotTicket,
    status_code=status.HTTP_201_CREATED,
    summary="Ask for a GPU's start-up slot (held at once if free, else waiting)",
    responses=problem_responses(429),
)
def take(body: SlotRequest, response: Response, daemon: DaemonDep, caller: CallerDep) -> SlotTicket:
    info = daemon.desk.take_slot(body, caller)
    response.headers["Location"] = f"/v1/startup-slots/{info.id}"
    return info


@router.get(
    "", response_model=list[SlotTicket], summary="Every start-up slot ticket the caller may touch"
)
def list_tickets(daemon: DaemonDep, caller: CallerDep) -> list[SlotTicket]:
    return daemon.desk.tickets(caller)


@router.get(
    "/{ticket_id}",
    response_model=SlotTicket,
    summary="One ticket; with wait_s, answers once its slot is held",
    responses=problem_responses(404, 409),
)
async def get_ticket(
    ticket_id: RegistrationId,
    daemon: DaemonDep,
    waits: WaitsDep,
    caller: CallerDep,
    wait_s: WaitS = 0.0,
) -> SlotTicket:
    def read() -> SlotTicket:
        return daemon.desk.ticket(ticket_id, caller, wait_s)

    return await waits.until(ticket_id, read, lambda t: t.state is SlotState.held, wait_s)


@router.delete(
    "/{ticket_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Give the slot back (or stop waiting for it)",
    responses=problem_responses(404, 409),
)
def give_back(ticket_id: RegistrationId, daemon: DaemonDep, caller: CallerDep) -> Response:
    daemon.desk.give_back(ticket_id, caller)
    return no_content()

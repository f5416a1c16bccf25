"""``/v1/startup-slots``: engines that share a GPU size their memory one after another.

An engine asks for its GPU's slot (``POST``) just before vLLM takes its memory snapshot, waits
for it with ``wait_s`` (a long-poll that holds no worker thread), and gives it back
(``DELETE``) once its KV cache is allocated and its graphs captured. A ticket is its caller's,
as a parked engine is (``/v1/parking``)."""

from __future__ import annotations

from protocol.schemas.startup_slots import SlotRequest, SlotState, SlotTicket
from service.api.routes.deps import caller_router
from service.api.routes.registrations import RegistrationRoutes
from service.registry.lease_desk import LeaseDesk

router = caller_router("/v1/startup-slots", "startup-slots")


RegistrationRoutes(
    request=SlotRequest,
    model=SlotTicket,
    id_name="ticket_id",
    names=("take", "list_tickets", "get_ticket", "give_back"),
    summaries=(
        "Ask for a GPU's start-up slot (held at once if free, else waiting)",
        "Every start-up slot ticket the caller may touch",
        "One ticket; with wait_s, answers once its slot is held",
        "Give the slot back (or stop waiting for it)",
    ),
    create_errors=(429,),
    wait_description="answer once the slot is held, or after this",
    create=LeaseDesk.take_slot,
    listed=LeaseDesk.tickets,
    read=LeaseDesk.ticket,
    done=lambda ticket: ticket.state is SlotState.held,
    remove=LeaseDesk.give_back,
).add_to(router)

"""Start-up slots: one engine at a time per GPU sizes its memory.

vLLM measures an engine's own use by the change in the GPU's free memory while it profiles, and
sizes the KV cache from what is left: another engine allocating on the same GPU meanwhile is
counted as this one's, and four engines started at once on one GPU left one of them a negative
KV cache. An engine asks for its GPU's slot just before vLLM takes its memory snapshot and gives
it back once its KV cache is allocated and its graphs captured.

The TP ranks of one engine ask under one group and are granted together, once every rank has
asked and all their GPUs are free, first come first served per GPU (a group waiting for a GPU
holds back later groups on it, so none starves and no two engines each hold half of what the
other needs). A held slot whose engine dies is given back by the reaper, and one held past
``hold_s`` is taken back, so one stuck engine delays the others at most that long.

A ticket is its caller's, as a parked engine is (:mod:`service.registry.parking`): the process
the kernel proved is the one watched, only its user or a trusted caller reads or gives it back,
and one user and one process hold at most their share (:mod:`.waiting_rules`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protocol.errors import (
    StartupSlotNotFoundError,
)
from protocol.logsafe import get_logger
from protocol.schemas.startup_slots import SlotRequest, SlotState, SlotTicket
from service.registry.lease_holders import Caller, Holder
from service.registry.waiting_rules import Registration, RoomWiring, WaitingRoom

log = get_logger(__name__)

SLOT_GRACE_S = 30.0  # a waiting ticket not asked for again within this is dropped


@dataclass(kw_only=True)
class Ticket(Registration):
    device: str
    asked_at: float
    state: SlotState = SlotState.waiting
    granted_at: float | None = None

    def info(self, boot_id: str, ahead: int) -> SlotTicket:
        return SlotTicket(
            **self.shown(boot_id),
            device=self.device,
            state=self.state,
            asked_at=self.asked_at,
            granted_at=self.granted_at,
            ahead=ahead,
        )


class StartupSlots(WaitingRoom[Ticket]):
    """One slot per GPU: the engines that share it take vLLM's memory snapshot and size their
    KV cache one at a time, so none counts another's start as its own use."""

    what = "start-up slot ticket"
    missing = StartupSlotNotFoundError

    def __init__(
        self,
        wiring: RoomWiring,
        hold_s: float,
        on_reclaim: Callable[[str], None] | None = None,
        grace_s: float = SLOT_GRACE_S,
    ) -> None:
        super().__init__(wiring, grace_s)
        self.hold_s = hold_s
        self.on_reclaim = on_reclaim

    def take(self, req: SlotRequest, now: float, holder: Holder) -> Ticket:
        """A ticket for ``req.device`` for ``holder`` (proven outside the lock): held at once if
        the GPU is free, else waiting."""
        with self.lock:
            ticket = Ticket(**self._admit(req, holder, None, now), device=req.device, asked_at=now)
            self.kept[ticket.id] = ticket
            self._grant(now)
            return ticket

    def get(self, ticket_id: str, now: float, caller: Caller, wait_s: float = 0.0) -> Ticket:
        """The ticket; a waiting one is kept ``wait_s`` plus the grace from now on."""
        with self.lock:
            ticket = self._find(ticket_id, caller)
            if ticket.state is SlotState.waiting:
                ticket.expires_at = max(ticket.expires_at, now + wait_s + self.grace_s)
            return ticket

    def give_back(self, ticket_id: str, now: float, caller: Caller) -> None:
        """The engine is done (or gives up waiting): the next engine may start."""
        with self.lock:
            self._find(ticket_id, caller)
            self._drop(ticket_id, now)

    def ahead(self, ticket: Ticket) -> int:
        """Engines (groups) that asked for this ticket's GPU before it and still wait or hold."""
        with self.lock:
            groups = set()
            for other in self.kept.values():
                if other.group == ticket.group:
                    break
                if other.device == ticket.device:
                    groups.add(other.group)
            return len(groups)

    def process_gone(self, pid: int, start: int, now: float) -> list[Ticket]:
        with self.lock:
            gone = self._of_process(pid, start)
            for ticket in gone:
                if ticket.state is SlotState.held and self.on_reclaim is not None:
                    self.on_reclaim("engine_gone")
                self._drop(ticket.id, now)
            return gone

    def expire(self, now: float) -> list[Ticket]:
        """Drop waiting tickets nobody asks for, and take back slots held past ``hold_s``."""
        with self.lock:
            stale = self._stale(now)
            for ticket in stale:
                if ticket.state is SlotState.held:
                    log.warning(
                        "start-up slot of %s held by pid %d for more than %.0f s: given to the "
                        "next engine",
                        ticket.device,
                        ticket.holder.shown_pid,
                        self.hold_s,
                    )
                    if self.on_reclaim is not None:
                        self.on_reclaim("hold_expired")
                self._drop(ticket.id, now)
            return stale

    def counts(self) -> dict[str, int]:
        with self.lock:
            counts = {state.value: 0 for state in SlotState}
            for ticket in self.kept.values():
                counts[ticket.state.value] += 1
            return counts

    # --- internals ---------------------------------------------------------------------------

    def _drop(self, ticket_id: str, now: float) -> None:
        if self.kept.pop(ticket_id, None) is not None:
            self._changed(ticket_id)
            self._grant(now)

    def _grant(self, now: float) -> None:
        """Grant every group that has asked with all its ranks, whose GPUs are free, and that
        no earlier waiting group is queued before on any of them."""
        held = {t.device for t in self.kept.values() if t.state is SlotState.held}
        queued: set[str] = set()  # GPUs an earlier group waits for
        groups: dict[str, list[Ticket]] = {}
        for ticket in self.kept.values():
            groups.setdefault(ticket.group, []).append(ticket)
        for members in groups.values():
            if any(t.state is SlotState.held for t in members):
                continue
            devices = {t.device for t in members}
            complete = {t.tp_rank for t in members} == set(range(members[0].tp_size))
            if not complete:
                continue  # a partial group holds nobody back
            if devices & (held | queued):
                queued |= devices
                continue
            for ticket in members:
                ticket.state = SlotState.held
                ticket.granted_at = now
                ticket.expires_at = now + self.hold_s
                self._changed(ticket.id)
            held |= devices

"""Start-up slot rules: one engine per GPU at a time, first come first served, TP groups granted
together without deadlock, slots taken back from dead or stuck engines."""

from __future__ import annotations

import pytest

from protocol.errors import (
    InvalidRequestError,
    RegistrationNotYoursError,
    StartupSlotNotFoundError,
)
from protocol.schemas.startup_slots import SlotRequest, SlotState
from service.registry.lease_holders import Caller
from service.registry.startup_slots import StartupSlots, Ticket
from tests.service.registry.processes import ME, OWNER, holder_of, start_of, wiring


class Slots:
    def __init__(self) -> None:
        self.changed: list[str] = []
        self.reclaims: list[str] = []
        self.slots = StartupSlots(
            wiring(on_change=self.changed.append),
            hold_s=100.0,
            on_reclaim=self.reclaims.append,
            grace_s=10.0,
        )

    def take(
        self,
        device: str,
        group: str,
        rank: int = 0,
        tp: int = 1,
        pid: int = ME,
        now=0.0,
        uid: int | None = OWNER.uid,
    ) -> Ticket:
        req = SlotRequest(device=device, tp_rank=rank, tp_size=tp, client_pid=pid, group=group)
        return self.slots.take(req, now, holder_of(pid, uid))

    def held(self) -> list[str]:
        return [
            f"{t.group}/{t.device}"
            for t in self.slots.entries(caller=OWNER)
            if t.state.value == "held"
        ]


def test_one_engine_per_gpu_in_the_order_they_asked() -> None:
    s = Slots()
    a = s.take("GPU-0", "a")
    b = s.take("GPU-0", "b")
    c = s.take("GPU-0", "c")
    other_gpu = s.take("GPU-1", "d")
    assert (a.state, b.state, c.state, other_gpu.state) == (
        SlotState.held,
        SlotState.waiting,
        SlotState.waiting,
        SlotState.held,
    )
    assert [s.slots.ahead(t) for t in (a, b, c)] == [0, 1, 2]
    s.slots.give_back(a.id, now=1.0, caller=OWNER)
    assert b.state is SlotState.held and c.state is SlotState.waiting
    assert b.granted_at == 1.0 and b.id in s.changed
    s.slots.give_back(b.id, now=2.0, caller=OWNER)
    assert c.state.value == "held"


def test_tp_groups_are_granted_whole_and_never_deadlock() -> None:
    """Engine x (GPUs 0 and 1) and engine y (the same GPUs) ask in crossed order: y's rank 1
    asks for GPU 1 before x's rank 1 does. Neither gets half: x, whose group was complete
    first, gets both GPUs, then y."""
    s = Slots()
    x0 = s.take("GPU-0", "x", 0, tp=2)
    y1 = s.take("GPU-1", "y", 1, tp=2)
    assert x0.state is SlotState.waiting and y1.state is SlotState.waiting  # incomplete groups
    x1 = s.take("GPU-1", "x", 1, tp=2)
    y0 = s.take("GPU-0", "y", 0, tp=2)
    assert (x0.state, x1.state) == (SlotState.held, SlotState.held)
    assert (y0.state, y1.state) == (SlotState.waiting, SlotState.waiting)
    s.slots.give_back(x0.id, now=1.0, caller=OWNER)
    assert y0.state is SlotState.waiting  # GPU 1 is still x's
    s.slots.give_back(x1.id, now=1.0, caller=OWNER)
    assert (y0.state, y1.state) == (SlotState.held, SlotState.held)


def test_a_waiting_group_holds_back_later_ones_on_its_gpus() -> None:
    """First come, first served per GPU: a single-GPU engine that asks after a waiting TP
    engine does not slip in ahead of it on their shared GPU."""
    s = Slots()
    s.take("GPU-1", "busy")
    tp0 = s.take("GPU-0", "tp", 0, tp=2)
    s.take("GPU-1", "tp", 1, tp=2)
    late = s.take("GPU-0", "late")
    assert tp0.state is SlotState.waiting and late.state is SlotState.waiting
    assert s.take("GPU-2", "elsewhere").state is SlotState.held


def test_dead_and_stuck_holders_lose_the_slot() -> None:
    s = Slots()
    start = start_of(ME)
    assert start is not None
    mine = s.take("GPU-0", "mine")
    theirs = s.take("GPU-0", "theirs", pid=1)
    assert (ME, start) in s.slots.watched()
    s.slots.process_gone(ME, start, now=5.0)
    assert theirs.state is SlotState.held
    assert mine.id not in {t.id for t in s.slots.entries(caller=OWNER)}
    assert s.reclaims == ["engine_gone"]
    third = s.take("GPU-0", "third", pid=1)
    s.slots.get(third.id, now=70.0, wait_s=30.0, caller=OWNER)  # a long poll keeps a waiting ticket
    assert s.slots.expire(now=104.0) == []
    assert [t.id for t in s.slots.expire(now=106.0)] == [theirs.id]  # held past hold_s
    assert s.reclaims == ["engine_gone", "hold_expired"]
    assert third.state is SlotState.held


def test_waiting_tickets_nobody_asks_for_are_dropped() -> None:
    s = Slots()
    s.take("GPU-0", "holder", pid=1, now=0.0)
    waiting = s.take("GPU-0", "gone", pid=1, now=0.0)
    assert [t.id for t in s.slots.expire(now=11.0)] == [waiting.id]
    assert s.reclaims == []


def test_bad_requests_and_unknown_tickets() -> None:
    s = Slots()
    s.take("GPU-0", "a")
    with pytest.raises(InvalidRequestError):
        s.take("GPU-0", "a", pid=1)  # rank 0 of group a again
    s.take("GPU-1", "b")
    with pytest.raises(StartupSlotNotFoundError):
        s.slots.give_back("b00t.0123", now=0.0, caller=OWNER)
    assert s.slots.counts() == {"waiting": 0, "held": 2}


def test_a_ticket_is_given_back_by_its_user_alone() -> None:
    s = Slots()
    owner, neighbour = (
        Caller(uid=4242, pid=None, via="unix"),
        Caller(uid=4343, pid=None, via="unix"),
    )
    ticket = s.take("GPU-0", "a", uid=4242)
    assert s.slots.entries(neighbour) == [] and s.slots.entries(owner) == [ticket]
    with pytest.raises(RegistrationNotYoursError):
        s.slots.give_back(ticket.id, 1.0, neighbour)
    s.slots.give_back(ticket.id, 1.0, owner)
    assert s.slots.entries(owner) == []

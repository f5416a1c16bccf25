"""What parked engines and start-up slot tickets share (:class:`WaitingRoom`), held for both:
caps in all, per process and per user; unknown and earlier-run ids refused by name; another
user's registration neither seen nor read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from protocol.errors import (
    DaemonRestartedError,
    ParkingNotFoundError,
    RegistrationNotYoursError,
    StartupSlotNotFoundError,
    TooManyClientParkedError,
    TooManyParkedError,
    TooManyUserParkedError,
    WeightCacheError,
)
from protocol.schemas.parking import ParkRequest
from protocol.schemas.startup_slots import SlotRequest
from service.registry.lease_holders import Caller
from service.registry.parking import ParkingLot
from service.registry.startup_slots import StartupSlots
from service.registry.waiting_rules import Registration, WaitingCaps
from tests.service.registry.processes import ME, OWNER, caps, holder_of, wiring


@dataclass
class Room:
    """One registry of waiting engines, and how a test registers one engine (one rank) in it."""

    room: ParkingLot | StartupSlots
    register: Callable[[str, int, int | None], Registration]  # (group, pid, uid)
    missing: type[WeightCacheError]  # the refusal for an id it does not keep


def parking(limits: WaitingCaps) -> Room:
    lot = ParkingLot(wiring(limits))

    def park(group: str, pid: int, uid: int | None) -> Registration:
        req = ParkRequest(model="m", tp_rank=0, tp_size=1, client_pid=pid, group=group)
        return lot.park(req, 0.0, holder_of(pid, uid))

    return Room(lot, park, ParkingNotFoundError)


def startup_slots(limits: WaitingCaps) -> Room:
    slots = StartupSlots(wiring(limits), hold_s=100.0)

    def take(group: str, pid: int, uid: int | None) -> Registration:
        req = SlotRequest(device=f"GPU-{group}", tp_rank=0, tp_size=1, client_pid=pid, group=group)
        return slots.take(req, 0.0, holder_of(pid, uid))

    return Room(slots, take, StartupSlotNotFoundError)


ROOMS = pytest.mark.parametrize("make", [parking, startup_slots], ids=["parking", "startup"])
Make = Callable[[WaitingCaps], Room]


@ROOMS
def test_caps_in_all_and_per_process(make: Make) -> None:
    r = make(caps(total=3, per_client=2))
    r.register("a", ME, OWNER.uid)
    r.register("b", ME, OWNER.uid)
    with pytest.raises(TooManyClientParkedError):
        r.register("c", ME, OWNER.uid)
    r.register("c", 1, OWNER.uid)
    with pytest.raises(TooManyParkedError):
        r.register("d", 2, OWNER.uid)
    assert len(r.room.entries(OWNER)) == 3


@ROOMS
def test_unknown_ids_say_why(make: Make) -> None:
    r = make(caps())
    with pytest.raises(r.missing):
        r.room.get("b00t.0123", 0.0, OWNER)
    with pytest.raises(DaemonRestartedError):
        r.room.get("0ld.0123", 0.0, OWNER)


@ROOMS
def test_a_registration_is_its_users_alone(make: Make) -> None:
    """Another user neither sees nor reads a user's registration; one user holds at most its
    share, and the other user keeps its room."""
    r = make(caps(per_uid=1))
    owner, neighbour = (
        Caller(uid=4242, pid=None, via="unix"),
        Caller(uid=4343, pid=None, via="unix"),
    )
    mine = r.register("a", ME, 4242)
    assert r.room.entries(neighbour) == [] and r.room.entries(owner) == [mine]
    with pytest.raises(RegistrationNotYoursError):
        r.room.get(mine.id, 1.0, neighbour)
    with pytest.raises(TooManyUserParkedError):
        r.register("b", ME, 4242)
    theirs = r.register("b", ME, 4343)
    assert r.room.entries(neighbour) == [theirs]

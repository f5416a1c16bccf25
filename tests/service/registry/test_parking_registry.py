"""Parking rules: who is released when, oldest first, TP ranks together, one waiting engine per
engine that ends, caps, expiry, and processes that go away."""

from __future__ import annotations

import pytest

from protocol.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    NothingParkedError,
    ParkingNotFoundError,
    RegistrationNotYoursError,
)
from protocol.schemas.parking import ParkRequest, ParkState, ReleaseCause
from service.registry.lease_holders import Caller, Holder
from service.registry.parking import Parked, ParkingLot
from service.registry.waiting_rules import WaitingCaps
from tests.service.registry.processes import ME, OWNER, caps, holder_of, start_of, wiring


class Lot:
    """A parking lot with its releases and changes recorded."""

    def __init__(self, limits: WaitingCaps | None = None) -> None:
        self.changed: list[str] = []
        self.serving: set[str] = set()  # models some engine holds a lease on
        self.releases: list[ReleaseCause] = []

        def known(model: str) -> None:
            if model not in ("m", "n"):
                raise ModelNotFoundError(f"no model {model}")

        self.lot = ParkingLot(
            wiring(limits, on_change=self.changed.append),
            on_release=self.releases.append,
            grace_s=10.0,
            known_model=known,
            serving=lambda model: model in self.serving,
        )

    def park(
        self,
        group: str,
        rank: int = 0,
        tp: int = 1,
        model: str = "m",
        pid: int = ME,
        now=0.0,
        if_serving: bool = False,
        uid: int | None = OWNER.uid,
    ) -> Parked:
        req = ParkRequest(
            model=model,
            tp_rank=rank,
            tp_size=tp,
            client_pid=pid,
            group=group,
            if_serving=if_serving,
        )
        return self.lot.park(req, now, holder_of(pid, uid))

    def ended(self, rank: int = 0, tp: int = 1, model: str = "m", gone: bool = True) -> None:
        """An engine's lease on ``model`` rank ``rank`` ended (its process gone, or a PID the
        daemon cannot watch)."""
        self.lot.lease_ended(model, rank, tp, 4242, None, process_gone=gone, now=5.0)

    def states(self) -> dict[str, ParkState]:
        return {p.group + f"/{p.tp_rank}": p.state for p in self.lot.entries(caller=OWNER)}


def test_an_engine_that_dies_releases_the_oldest_parked_one() -> None:
    lot = Lot()
    first = lot.park("a", now=1.0)
    lot.park("b", now=2.0)
    lot.ended()
    assert lot.states() == {"a/0": ParkState.released, "b/0": ParkState.parked}
    assert first.cause is ReleaseCause.reaped and first.released_at == 5.0
    assert lot.releases == [ReleaseCause.reaped]
    assert first.id in lot.changed
    lot.ended(gone=False)  # a lease released by a process the daemon cannot watch
    assert lot.states()["b/0"] is ParkState.released
    assert lot.releases == [ReleaseCause.reaped, ReleaseCause.lease_ended]


def test_ends_of_other_models_and_sizes_release_nothing() -> None:
    lot = Lot()
    lot.park("a")
    lot.ended(model="n")
    lot.ended(tp=2)
    assert lot.states() == {"a/0": ParkState.parked}


def test_ends_before_any_engine_parked_are_not_banked() -> None:
    lot = Lot()
    lot.ended()
    lot.ended()
    lot.park("a")
    assert lot.states() == {"a/0": ParkState.parked}


def test_tp_ranks_are_released_together_once_every_rank_of_the_ended_engine_is_gone() -> None:
    lot = Lot()
    for group in ("a", "b"):
        for rank in (0, 1):
            lot.park(group, rank, tp=2)
    lot.ended(rank=0, tp=2)  # the dead engine's first rank, in one sweep
    assert set(lot.states().values()) == {ParkState.parked}
    lot.ended(rank=1, tp=2)  # its second, in the next
    assert lot.states() == {
        "a/0": ParkState.released,
        "a/1": ParkState.released,
        "b/0": ParkState.parked,
        "b/1": ParkState.parked,
    }
    assert lot.releases == [ReleaseCause.reaped]  # one engine ended: one released


def test_a_group_still_parking_its_ranks_is_released_once_complete() -> None:
    lot = Lot()
    lot.park("a", 0, tp=2)
    lot.ended(0, tp=2)
    lot.ended(1, tp=2)
    assert lot.states() == {"a/0": ParkState.parked}
    lot.park("a", 1, tp=2)  # the owed release goes to the first engine to be complete
    assert set(lot.states().values()) == {ParkState.released}


def test_a_lease_released_by_a_live_process_counts_once_the_process_is_gone() -> None:
    lot = Lot()
    lot.park("a", pid=1)  # PID 1 (init): watched, alive
    start = start_of(ME)
    assert start is not None
    lot.lot.lease_ended("m", 0, 1, ME, start, process_gone=False, now=5.0)
    assert lot.states() == {"a/0": ParkState.parked}  # its KV cache may still be allocated
    assert (ME, start) in lot.lot.watched()
    lot.lot.process_gone(ME, start, now=6.0)
    assert lot.states() == {"a/0": ParkState.released}
    assert lot.releases == [ReleaseCause.lease_ended]
    assert (ME, start) not in lot.lot.watched()


def test_a_parked_engine_whose_process_is_gone_is_forgotten() -> None:
    lot = Lot()
    entry = lot.park("a")
    start = start_of(ME)
    assert start is not None
    assert lot.lot.process_gone(ME, start, now=1.0) == [entry]
    assert lot.lot.entries(caller=OWNER) == [] and entry.id in lot.changed


def test_operator_release_by_id_and_by_model() -> None:
    lot = Lot()
    a0 = lot.park("a", 0, tp=2, now=1.0)
    lot.park("a", 1, tp=2, now=1.0)
    lot.park("b", 0, tp=1, now=2.0)
    lot.park("c", 0, tp=1, now=3.0)
    released = lot.lot.release(a0.id, ReleaseCause.operator, now=4.0, caller=OWNER)
    assert sorted(p.tp_rank for p in released) == [0, 1]
    assert {p.cause for p in released} == {ReleaseCause.operator}
    (oldest,) = lot.lot.release_oldest("m", None, ReleaseCause.operator, now=5.0, caller=OWNER)
    assert oldest.group == "b"
    (at_size,) = lot.lot.release_oldest("m", 1, ReleaseCause.operator, now=5.0, caller=OWNER)
    assert at_size.group == "c"
    with pytest.raises(NothingParkedError):
        lot.lot.release_oldest("m", None, ReleaseCause.operator, now=6.0, caller=OWNER)
    assert lot.releases == [ReleaseCause.operator] * 3


def test_an_incomplete_group_cannot_be_released() -> None:
    lot = Lot()
    half = lot.park("a", 0, tp=2)
    with pytest.raises(NothingParkedError):
        lot.lot.release(half.id, ReleaseCause.operator, now=1.0, caller=OWNER)
    with pytest.raises(NothingParkedError):
        lot.lot.release_oldest("m", 2, ReleaseCause.operator, now=1.0, caller=OWNER)


def test_cancel_takes_the_whole_group_out_of_the_queue() -> None:
    lot = Lot()
    a0 = lot.park("a", 0, tp=2)
    lot.park("a", 1, tp=2)
    lot.park("b", 0, tp=2)
    lot.park("b", 1, tp=2)
    cancelled = lot.lot.cancel(a0.id, now=1.0, caller=OWNER)
    assert {p.state for p in cancelled} == {ParkState.cancelled}
    lot.ended(0, tp=2)
    lot.ended(1, tp=2)
    assert lot.states()["b/0"] is ParkState.released  # the cancelled one is skipped


def test_withdraw_forgets() -> None:
    lot = Lot()
    entry = lot.park("a")
    assert lot.lot.get(entry.id, now=1.0, caller=OWNER) is entry
    lot.lot.withdraw(entry.id, caller=OWNER)
    with pytest.raises(ParkingNotFoundError):
        lot.lot.get(entry.id, now=1.0, caller=OWNER)


def test_bad_groups_and_unknown_models_are_refused() -> None:
    lot = Lot()
    lot.park("a", 0, tp=2)
    with pytest.raises(InvalidRequestError):
        lot.park("a", 0, tp=2)  # the same rank twice
    with pytest.raises(InvalidRequestError):
        lot.park("a", 1, tp=2, model="n")  # another model under one group
    with pytest.raises(ModelNotFoundError):
        lot.park("z", model="nope")


def test_registrations_not_asked_for_expire_and_polls_keep_them() -> None:
    lot = Lot()
    kept = lot.park("a", now=0.0)
    dropped = lot.park("b", pid=1, now=0.0)
    lot.lot.get(
        kept.id, now=5.0, wait_s=30.0, caller=OWNER
    )  # a long-poll: kept through it plus the grace
    assert [p.id for p in lot.lot.expire(now=20.0)] == [dropped.id]
    assert lot.lot.expire(now=40.0) == []
    assert [p.id for p in lot.lot.expire(now=46.0)] == [kept.id]


def test_summary_per_model() -> None:
    lot = Lot()
    lot.park("a", now=3.0)
    lot.park("b", pid=1, now=2.0)
    lot.park("c", pid=1, model="n", now=1.0)
    summary = lot.lot.summary("m")
    assert (summary.count, summary.since, summary.pids) == (2, 2.0, sorted({1, ME}))
    assert lot.lot.summary("other").count == 0
    assert lot.lot.count_waiting() == 3


def test_if_serving_waits_only_while_an_engine_holds_a_lease() -> None:
    """A restarted engine that parks with if_serving waits behind the engine now serving, and
    starts at once when none is (its TP ranks once all have parked)."""
    lot = Lot()
    lot.serving.add("m")
    behind = lot.park("a", if_serving=True)
    assert behind.state is ParkState.parked
    lot.serving.clear()
    half = lot.park("b", 0, tp=2, if_serving=True)
    assert half.state is ParkState.parked  # its other rank has not parked yet
    lot.park("b", 1, tp=2, if_serving=True)
    assert half.state.value == "released" and half.cause is ReleaseCause.unserved
    always = lot.park("c")  # park: true waits whoever serves
    assert always.state is ParkState.parked
    assert lot.releases == [ReleaseCause.unserved]


def test_a_registration_is_its_users_alone() -> None:
    """Another user neither sees, releases, cancels, withdraws nor joins a user's parked engine
    (test_waiting_rooms holds the caps and reads)."""
    lot = Lot()
    owner, neighbour = (
        Caller(uid=4242, pid=None, via="unix"),
        Caller(uid=4343, pid=None, via="unix"),
    )
    mine = lot.park("a", 0, tp=2, uid=4242)
    assert lot.lot.entries(neighbour) == [] and lot.lot.entries(owner) == [mine]
    for refused in (
        lambda: lot.lot.get(mine.id, 1.0, neighbour),
        lambda: lot.lot.release(mine.id, ReleaseCause.operator, 1.0, neighbour),
        lambda: lot.lot.cancel(mine.id, 1.0, neighbour),
        lambda: lot.lot.withdraw(mine.id, neighbour),
        lambda: lot.park("a", 1, tp=2, uid=4343),
    ):
        with pytest.raises(RegistrationNotYoursError):
            refused()
    lot.park("a", 1, tp=2, uid=4242)
    with pytest.raises(NothingParkedError):  # none of the neighbour's own
        lot.lot.release_oldest("m", None, ReleaseCause.operator, 1.0, neighbour)
    lot.park("c", uid=4343)
    released = lot.lot.release_oldest("m", 2, ReleaseCause.operator, 1.0, owner)
    assert {p.state for p in released} == {ParkState.released}


def test_engines_out_of_sight_are_capped_by_their_user_alone() -> None:
    """Engines in containers of their own name pids of their own namespaces, often the same
    small number: those are not counted as one process."""
    lot = Lot(caps(per_client=1))
    out_of_sight = Holder(uid=None, pid=None, pid_start=None, named_pid=7)
    for group in ("a", "b", "c"):
        req = ParkRequest(model="m", tp_rank=0, tp_size=1, client_pid=7, group=group)
        lot.lot.park(req, 0.0, out_of_sight)
    assert len(lot.lot.entries(OWNER)) == 3

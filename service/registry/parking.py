"""Engines waiting to take over: parked ones, started ahead of need, each waiting at its load step
(holding only its CUDA context), and warm standbys, started all the way and asleep (registered
by ``weight-cache standby``), until the daemon releases them.

One is released when an engine that held a lease on the same model and TP size ends (the
reaper finds its process gone, or it released its lease and then exited), or when an operator
asks. The TP ranks of one engine park under one group and are released together, oldest group
first; an engine that ends releases one group once each of its ranks has ended, so a TP engine's
two leases ending in two sweeps release one waiting engine, not two.

A warm standby holds leases itself (taken under its group, ``standby_group``): they are not
serving while it waits, so they neither keep a standby with ``if_serving`` waiting nor release
anyone when they end; releasing the standby promotes them (``promote``).

A registration is its caller's (:mod:`service.registry.lease_holders`): the process watched is
the one the kernel proved, and it is read, released, cancelled or withdrawn only by its user or a
trusted caller; one user and one process hold at most their share (:mod:`.waiting_rules`).

Everything runs under the daemon's lock; ``on_change`` is told the id of every registration
whose state changed (the API wakes its long-polls with it), ``on_release`` the cause of every
group released (the metrics count them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.errors import (
    NothingParkedError,
    ParkingNotFoundError,
)
from protocol.schemas.parking import (
    ParkedEngine,
    ParkedSummary,
    ParkRequest,
    ParkState,
    ReleaseCause,
)
from service.registry.lease_holders import Caller, Holder
from service.registry.waiting_rules import Registration, RoomWiring, WaitingRoom

# Seconds a registration is kept past its last poll (or its end) without being asked for again.
PARK_GRACE_S = 30.0

GroupKey = tuple[str, int]  # (model, tp_size): parked engines that can replace one another


@dataclass(kw_only=True)
class Parked(Registration):
    model: str
    parked_at: float
    standby: bool = False
    state: ParkState = ParkState.parked
    released_at: float | None = None
    cause: ReleaseCause | None = None

    @property
    def kind(self) -> object:
        return (self.model, self.standby)  # the ranks of one engine wait alike, for one model

    @property
    def key(self) -> GroupKey:
        return (self.model, self.tp_size)

    def info(self, boot_id: str) -> ParkedEngine:
        return ParkedEngine(
            **self.shown(boot_id),
            model=self.model,
            standby=self.standby,
            state=self.state,
            parked_at=self.parked_at,
            released_at=self.released_at,
            cause=self.cause,
        )


@dataclass
class _Departing:
    """Ranks whose lease ended while their engine's process still ran: each counts once the
    process is gone (its GPU memory freed), and only if an engine waits for that model."""

    ranks: set[tuple[GroupKey, int]] = field(default_factory=set)


class ParkingLot(WaitingRoom[Parked]):
    """Engines started ahead of need, each rank waiting here until the daemon releases it: an
    engine on its model ended (process gone, lease released) or an operator asked. A released
    standby's leases then count as serving."""

    what = "parked engine"
    missing = ParkingNotFoundError

    def __init__(
        self,
        wiring: RoomWiring,
        on_release: Callable[[ReleaseCause], None] | None = None,
        grace_s: float = PARK_GRACE_S,
        known_model: Callable[[str], object] | None = None,
        serving: Callable[[str], bool] | None = None,
        promote: Callable[[str, int | None], object] | None = None,
    ) -> None:
        super().__init__(wiring, grace_s)
        self.known_model = known_model  # raises for a model the daemon does not hold
        self.serving = serving  # whether an engine serves a model (not a standby's lease)
        self.promote = promote  # a released standby's group and user: its leases now serve
        self.on_release = on_release
        self._groups: dict[str, list[str]] = {}  # group -> ids, oldest group first
        self._credits: dict[GroupKey, Counter[int]] = {}  # ranks of engines that ended
        self._departing: dict[tuple[int, int], _Departing] = {}  # (pid, start) -> ranks

    # --- engines parking and asking ----------------------------------------------------------

    def park(self, req: ParkRequest, now: float, holder: Holder) -> Parked:
        """Register a parked engine (rank) for ``holder`` (proven outside the lock); released at
        once if engines of its model ended while others of its kind already waited."""
        with self.lock:
            if self.known_model is not None:
                self.known_model(req.model)
            entry = Parked(
                **self._admit(req, holder, (req.model, req.standby), now),
                model=req.model,
                standby=req.standby,
                parked_at=now,
            )
            self.kept[entry.id] = entry
            self._groups.setdefault(req.group, []).append(entry.id)
            self._settle(entry.key, ReleaseCause.lease_ended, now)  # engines ended before it
            unserved = self.serving is not None and not self.serving(req.model)
            if req.if_serving and unserved and self._complete(req.group):
                self._release_group(req.group, ReleaseCause.unserved, now)  # nobody to wait for
            return entry

    def get(self, parked_id: str, now: float, caller: Caller, wait_s: float = 0.0) -> Parked:
        """The registration, kept for its engine ``wait_s`` plus the grace from now on."""
        with self.lock:
            entry = self._find(parked_id, caller)
            entry.expires_at = max(entry.expires_at, now + wait_s + self.grace_s)
            return entry

    def withdraw(self, parked_id: str, caller: Caller) -> None:
        """The engine is done waiting (released, cancelled, or given up): forget it."""
        with self.lock:
            self._find(parked_id, caller)
            self._forget(parked_id)

    # --- releasing and cancelling ------------------------------------------------------------

    def release(
        self, parked_id: str, cause: ReleaseCause, now: float, caller: Caller
    ) -> list[Parked]:
        """Release the engine ``parked_id`` belongs to (every rank of it)."""
        with self.lock:
            entry = self._find(parked_id, caller)
            if entry.state is not ParkState.parked:
                return self._members(entry.group)
            if not self._complete(entry.group):
                raise NothingParkedError(
                    f"engine {entry.group} has parked {len(self._members(entry.group))} of its "
                    f"{entry.tp_size} ranks: its ranks are released together",
                    group=entry.group,
                )
            return self._release_group(entry.group, cause, now)

    def release_oldest(
        self, model: str, tp_size: int | None, cause: ReleaseCause, now: float, caller: Caller
    ) -> list[Parked]:
        """Release the oldest engine parked in full for ``model`` (at ``tp_size``, if given)
        among those ``caller`` may manage."""
        with self.lock:
            group = self._oldest(model, tp_size, caller)
            if group is None:
                raise NothingParkedError(
                    f"no engine of model {model!r}"
                    + (f" at tp_size {tp_size}" if tp_size else "")
                    + " is parked with every rank",
                    model=model,
                )
            return self._release_group(group, cause, now)

    def cancel(self, parked_id: str, now: float, caller: Caller) -> list[Parked]:
        """Cancel the engine ``parked_id`` belongs to: its ranks fall back or fail."""
        with self.lock:
            entry = self._find(parked_id, caller)
            return self._cancel_group(entry.group, now)

    def standby_engine_gone(self, group: str, holder_uid: int | None, now: float) -> None:
        """A sleeping standby's engine died (a lease of its group was reaped): it can take over
        no more, so it is cancelled, not released when the serving engine ends."""
        with self.lock:
            members = self._members(group)
            if members and members[0].standby and members[0].holder.uid == holder_uid:
                self._cancel_group(group, now)

    # --- engines that end --------------------------------------------------------------------

    def lease_ended(
        self,
        model: str,
        tp_rank: int,
        tp_size: int,
        pid: int | None,
        pid_start: int | None,
        process_gone: bool,
        now: float,
    ) -> None:
        """A lease on ``model`` ended. Its rank counts toward releasing a parked engine once its
        process is gone (now, if the reaper ended it or the PID cannot be watched)."""
        with self.lock:
            key = (model, tp_size)
            if not self._waiting(key):
                return
            if process_gone or pid is None or pid_start is None:
                cause = ReleaseCause.reaped if process_gone else ReleaseCause.lease_ended
                self._credit(key, tp_rank, cause, now)
                return
            self._departing.setdefault((pid, pid_start), _Departing()).ranks.add((key, tp_rank))

    def watched(self) -> list[tuple[int, int]]:
        """(PID, start) of every process whose end matters here: parked engines, and engines
        that ended a lease while a parked engine waits for their model."""
        with self.lock:
            return sorted({*super().watched(), *self._departing})

    def process_gone(self, pid: int, start: int, now: float) -> list[Parked]:
        """The process ``pid`` (started at ``start``) is gone: forget its registrations, and
        count the ranks it served."""
        with self.lock:
            gone = self._of_process(pid, start)
            for entry in gone:
                self._forget(entry.id)
            departing = self._departing.pop((pid, start), None)
            for key, rank in sorted(departing.ranks) if departing else ():
                self._credit(key, rank, ReleaseCause.lease_ended, now)
            return gone

    def expire(self, now: float) -> list[Parked]:
        """Forget registrations not asked for within their expiry (an engine that stopped
        polling from a PID the daemon cannot watch, or never collected its release)."""
        with self.lock:
            stale = self._stale(now)
            for entry in stale:
                self._forget(entry.id)
            return stale

    # --- views -------------------------------------------------------------------------------

    def summary(self, model: str) -> ParkedSummary:
        with self.lock:
            waiting = [
                p for p in self.kept.values() if p.model == model and p.state is ParkState.parked
            ]
            return ParkedSummary(
                count=len(waiting),
                standby=sum(1 for p in waiting if p.standby),
                since=min((p.parked_at for p in waiting), default=None),
                pids=sorted({p.holder.shown_pid for p in waiting}),
            )

    def count_waiting(self) -> int:
        with self.lock:
            return sum(1 for p in self.kept.values() if p.state is ParkState.parked)

    # --- internals ---------------------------------------------------------------------------

    def _members(self, group: str) -> list[Parked]:
        return [self.kept[i] for i in self._groups.get(group, [])]

    def _complete(self, group: str) -> bool:
        members = self._members(group)
        return (
            bool(members)
            and all(m.state is ParkState.parked for m in members)
            and {m.tp_rank for m in members} == set(range(members[0].tp_size))
        )

    def _waiting(self, key: GroupKey) -> bool:
        return any(p.key == key and p.state is ParkState.parked for p in self.kept.values())

    def _oldest(self, model: str, tp_size: int | None, caller: Caller | None = None) -> str | None:
        """The oldest group parked in full (that ``caller``, if given, may manage)."""
        for group, ids in self._groups.items():
            first = self.kept[ids[0]]
            if first.model != model or (tp_size is not None and first.tp_size != tp_size):
                continue
            if caller is not None and not caller.may_manage(first.holder.uid):
                continue
            if self._complete(group):
                return group
        return None

    def _credit(self, key: GroupKey, rank: int, cause: ReleaseCause, now: float) -> None:
        self._credits.setdefault(key, Counter())[rank] += 1
        self._settle(key, cause, now)

    def _settle(self, key: GroupKey, cause: ReleaseCause, now: float) -> None:
        """Release one parked engine per engine that ended (every one of its ranks)."""
        credits = self._credits.get(key)
        if credits is None:
            return
        model, tp_size = key
        while all(credits[rank] > 0 for rank in range(tp_size)):
            group = self._oldest(model, tp_size)
            if group is None:
                break
            for rank in range(tp_size):
                credits[rank] -= 1
            self._release_group(group, cause, now)
        if not self._waiting(key):
            del self._credits[key]  # ends are not banked for engines that park later

    def _cancel_group(self, group: str, now: float) -> list[Parked]:
        """Every rank of ``group`` still waiting is cancelled (it falls back, fails or stops)."""
        members = self._members(group)
        for member in members:
            if member.state is ParkState.parked:
                member.state = ParkState.cancelled
                member.expires_at = now + self.grace_s
                self._changed(member.id)
        return members

    def _release_group(self, group: str, cause: ReleaseCause, now: float) -> list[Parked]:
        members = self._members(group)
        for member in members:
            member.state = ParkState.released
            member.released_at = now
            member.cause = cause
            member.expires_at = now + self.grace_s
            self._changed(member.id)
        if members and members[0].standby and self.promote is not None:
            self.promote(group, members[0].holder.uid)
        if self.on_release is not None:
            self.on_release(cause)
        return members

    def _forget(self, parked_id: str) -> None:
        entry = self.kept.pop(parked_id, None)
        if entry is None:
            return
        ids = self._groups.get(entry.group, [])
        if parked_id in ids:
            ids.remove(parked_id)
        if not ids:
            self._groups.pop(entry.group, None)
        if not self._waiting(entry.key):
            self._credits.pop(entry.key, None)
        self._changed(parked_id)

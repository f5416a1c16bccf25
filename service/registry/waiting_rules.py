"""What parked engines and start-up slot tickets share: one rank of one engine, its caller's
(:class:`Registration`), found only by its user or a trusted caller (:func:`find`); how many the
daemon keeps (in all, per user and per process, so that one neighbour cannot take every place);
and who may join an engine's group (its own user, each rank once, at one TP size)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from protocol.errors import (
    DaemonRestartedError,
    InvalidRequestError,
    RegistrationNotYoursError,
    TooManyClientParkedError,
    TooManyParkedError,
    TooManyUserParkedError,
    WeightCacheError,
)
from service.registry.lease_holders import Caller, Holder
from service.registry.run_ids import from_this_run, new_id


@dataclass(kw_only=True)
class Registration:
    """One TP rank of one engine waiting on the daemon, tied to its caller."""

    id: str
    tp_rank: int
    tp_size: int
    group: str  # shared by the ranks of one engine
    holder: Holder  # its caller, as the kernel proved it
    expires_at: float

    @property
    def kind(self) -> object:
        """What else the ranks of one group must share (nothing, unless a subclass says)."""
        return None

    def shown(self, boot_id: str) -> dict[str, Any]:
        """The fields both answers (``ParkedEngine``, ``SlotTicket``) show alike."""
        return {
            "id": self.id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "group": self.group,
            "client_pid": self.holder.shown_pid,
            "pid_watched": self.holder.pid_start is not None,
            "boot_id": boot_id,
            "expires_at": self.expires_at,
        }


R = TypeVar("R", bound=Registration)


def processes_of(kept: Iterable[Registration]) -> set[tuple[int, int]]:
    """(PID, start) of every process watched for ``kept``."""
    return {process for r in kept if (process := r.holder.process) is not None}


def find(
    kept: Mapping[str, R],
    registration_id: str,
    caller: Caller,
    boot_id: str,
    what: str,
    missing: type[WeightCacheError],
) -> R:
    """The registration ``registration_id`` (say ``what`` "parked engine") if ``caller`` may
    manage it; one of an earlier daemon run, one forgotten (``missing``) and another user's are
    refused, typed."""
    entry = kept.get(registration_id)
    if entry is None:
        if not from_this_run(registration_id, boot_id):
            raise DaemonRestartedError(
                f"the {what} is from an earlier run of the daemon; register again",
                boot_id=boot_id,
            )
        raise missing(f"no {what} {registration_id}")
    if not caller.may_manage(entry.holder.uid):
        raise RegistrationNotYoursError(
            f"{what} {registration_id} is another user's", registration=registration_id
        )
    return entry


@dataclass(frozen=True)
class WaitingCaps:
    total: int  # --max-parked
    per_uid: int  # --max-parked-per-uid
    per_client: int  # --max-parked-per-client

    def check(
        self, what: str, registered: Iterable[Registration], holder: Holder, group: str
    ) -> None:
        """Refuse one more ``what`` (say "parked engines") for ``holder``, given every
        registration kept. A holder whose process the daemon cannot see (another container's
        pid, likely the same small number as its neighbours') is counted by its user alone, as
        leases are."""
        kept = list(registered)
        if len(kept) >= self.total:
            raise TooManyParkedError(
                f"the daemon keeps at most {self.total} {what}", limit=self.total
            )
        theirs = sum(1 for r in kept if r.holder.uid == holder.uid)
        if holder.uid is not None and theirs >= self.per_uid:
            raise TooManyUserParkedError(
                f"uid {holder.uid} has {theirs} {what}", uid=holder.uid, limit=self.per_uid
            )
        pid = holder.pid
        if pid is None:
            return
        # Per process, engines (groups) count: a warm standby registers every rank of its
        # engine from one process, a parked engine's ranks each from their own.
        groups = {r.group for r in kept if r.holder.watched_pid == pid}
        if group not in groups and len(groups) >= self.per_client:
            raise TooManyClientParkedError(
                f"process {pid} has {len(groups)} {what}", client_pid=pid, limit=self.per_client
            )


@dataclass(frozen=True)
class Joining:
    """What a group's check needs of the registration asking to join it."""

    holder_uid: int | None
    tp_rank: int
    tp_size: int
    kind: object  # what else must match (:attr:`Registration.kind`)


def check_joins_group(group: str, members: Iterable[Registration], joining: Joining) -> None:
    """Refuse ``joining`` into ``group`` when another user's engine holds it, or when the group
    already has its rank or is of another TP size or kind."""
    kept = list(members)
    if any(m.holder.uid != joining.holder_uid for m in kept):
        raise RegistrationNotYoursError(f"group {group} is another user's", group=group)
    if any(
        (m.tp_size, m.kind) != (joining.tp_size, joining.kind) or m.tp_rank == joining.tp_rank
        for m in kept
    ):
        raise InvalidRequestError(
            f"group {group} already has rank {joining.tp_rank}, or another TP size or model: "
            "each rank of one engine registers once, under one group",
            group=group,
        )


class Changes:
    """Who hears that a parked engine or a start-up slot ticket changed (the API's long-polls
    subscribe): called, under the daemon's lock, with the id of each one that changed."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[str], None]] = []

    def subscribe(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def __call__(self, changed_id: str) -> None:
        for listener in self._listeners:
            listener(changed_id)


class RankRequest(Protocol):
    """What a request to wait (``ParkRequest``, ``SlotRequest``) says of its rank."""

    tp_rank: int
    tp_size: int
    group: str


@dataclass(frozen=True)
class RoomWiring:
    """What the waiting rooms of one daemon share: its boot id (in every id they hand out), the
    daemon's lock, the caps (each room counts its own registrations against them), and who is
    told of each change (the API's long-polls)."""

    boot_id: str
    lock: threading.RLock
    caps: WaitingCaps
    on_change: Callable[[str], None] | None = None


class WaitingRoom(Generic[R]):
    """What the registries of waiting engines (parked engines, start-up slot tickets) share:
    their registrations by id (insertion order: first come first), admitted within the caps
    and their group's rules, found only by their user or a trusted caller, watched by their
    process, and each change told to ``on_change``. Callers hold or take the daemon's lock."""

    what: ClassVar[str]  # one registration, in words ("parked engine")
    missing: ClassVar[type[WeightCacheError]]  # the refusal for an id not kept

    def __init__(self, wiring: RoomWiring, grace_s: float) -> None:
        self.boot_id = wiring.boot_id
        self.lock = wiring.lock
        self.caps = wiring.caps
        self.on_change = wiring.on_change
        self.grace_s = grace_s  # kept this long past its last poll or its end
        self.kept: dict[str, R] = {}

    def _admit(self, req: RankRequest, holder: Holder, kind: object, now: float) -> dict[str, Any]:
        """The fields every registration of ``req`` starts with, once ``holder`` has room and
        may join the request's group (``kind``: what else its ranks must share)."""
        self.caps.check(f"{self.what}s", self.kept.values(), holder, req.group)
        members = [r for r in self.kept.values() if r.group == req.group]
        check_joins_group(req.group, members, Joining(holder.uid, req.tp_rank, req.tp_size, kind))
        return {
            "id": new_id(self.boot_id),
            "tp_rank": req.tp_rank,
            "tp_size": req.tp_size,
            "group": req.group,
            "holder": holder,
            "expires_at": now + self.grace_s,
        }

    def _find(self, registration_id: str, caller: Caller) -> R:
        return find(self.kept, registration_id, caller, self.boot_id, self.what, self.missing)

    def entries(self, caller: Caller) -> list[R]:
        """The registrations ``caller`` may manage (every one for a trusted caller)."""
        with self.lock:
            return [r for r in self.kept.values() if caller.may_manage(r.holder.uid)]

    def watched(self) -> list[tuple[int, int]]:
        """(PID, start) of every process whose end matters here."""
        with self.lock:
            return sorted(processes_of(self.kept.values()))

    def _of_process(self, pid: int, start: int) -> list[R]:
        return [r for r in self.kept.values() if r.holder.process == (pid, start)]

    def _stale(self, now: float) -> list[R]:
        return [r for r in self.kept.values() if r.expires_at < now]

    def _changed(self, registration_id: str) -> None:
        if self.on_change is not None:
            self.on_change(registration_id)

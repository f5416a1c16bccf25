"""What parked engines and start-up slot tickets share: one rank of one engine, its caller's
(:class:`Registration`), found only by its user or a trusted caller (:func:`find`); how many the
daemon keeps (in all, per user and per process, so that one neighbour cannot take every place);
and who may join an engine's group (its own user, each rank once, at one TP size)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

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
from service.registry.run_ids import from_this_run


@dataclass(kw_only=True)
class Registration:
    """One TP rank of one engine waiting on the daemon, tied to its caller."""

    id: str
    tp_rank: int
    tp_size: int
    group: str  # shared by the ranks of one engine
    client_pid: int  # the process watched, else the pid the engine named
    pid_start: int | None  # None: the process is not visible here, nor watched
    holder_uid: int | None  # the caller's uid as the kernel proved it (None: a token holder)
    expires_at: float

    @property
    def watched_pid(self) -> int | None:
        """The process the daemon watches for it, if any (what per-process caps count)."""
        return self.client_pid if self.pid_start is not None else None

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
            "client_pid": self.client_pid,
            "pid_watched": self.pid_start is not None,
            "boot_id": boot_id,
            "expires_at": self.expires_at,
        }


R = TypeVar("R", bound=Registration)


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
    if not caller.may_manage(entry.holder_uid):
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
        theirs = sum(1 for r in kept if r.holder_uid == holder.uid)
        if holder.uid is not None and theirs >= self.per_uid:
            raise TooManyUserParkedError(
                f"uid {holder.uid} has {theirs} {what}", uid=holder.uid, limit=self.per_uid
            )
        pid = holder.pid
        if pid is None:
            return
        # Per process, engines (groups) count: a warm standby registers every rank of its
        # engine from one process, a parked engine's ranks each from their own.
        groups = {r.group for r in kept if r.watched_pid == pid}
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
    if any(m.holder_uid != joining.holder_uid for m in kept):
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

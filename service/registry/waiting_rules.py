"""The rules parked engines and start-up slot tickets share: how many the daemon keeps (in all,
per user and per process, so that one neighbour cannot take every place), and who may join an
engine's group (its own user, each rank once, at one TP size)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protocol.errors import (
    InvalidRequestError,
    RegistrationNotYoursError,
    TooManyClientParkedError,
    TooManyParkedError,
    TooManyUserParkedError,
)
from service.registry.lease_holders import Holder


@dataclass(frozen=True)
class WaitingCaps:
    total: int  # --max-parked
    per_uid: int  # --max-parked-per-uid
    per_client: int  # --max-parked-per-client

    def check(
        self, what: str, registered: Iterable[tuple[int | None, int | None]], holder: Holder
    ) -> None:
        """Refuse one more ``what`` (say "parked engines") for ``holder``, given the (holder
        uid, watched pid) of every registration kept. A holder whose process the daemon cannot see
        (another container's pid, likely the same small number as its neighbours') is counted
        by its user alone, as leases are."""
        kept = list(registered)
        if len(kept) >= self.total:
            raise TooManyParkedError(
                f"the daemon keeps at most {self.total} {what}", limit=self.total
            )
        theirs = sum(1 for uid, _ in kept if uid == holder.uid)
        if holder.uid is not None and theirs >= self.per_uid:
            raise TooManyUserParkedError(
                f"uid {holder.uid} has {theirs} {what}", uid=holder.uid, limit=self.per_uid
            )
        pid = holder.pid
        if pid is None:
            return
        mine = sum(1 for _, other in kept if other == pid)
        if mine >= self.per_client:
            raise TooManyClientParkedError(
                f"process {pid} has {mine} {what}", client_pid=pid, limit=self.per_client
            )


@dataclass(frozen=True)
class Member:
    """What a group's check needs of one registration already in it."""

    holder_uid: int | None
    tp_rank: int
    tp_size: int
    kind: object  # what else must match (the model of a parked engine; nothing for a slot)


def check_joins_group(group: str, members: Iterable[Member], joining: Member) -> None:
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

"""How many parked engines and start-up slot tickets the daemon keeps: in all, per user and per
process, so that one neighbour cannot take every place (one rule for both registries)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protocol.errors import TooManyClientParkedError, TooManyParkedError, TooManyUserParkedError
from service.registry.lease_holders import Holder


@dataclass(frozen=True)
class WaitingCaps:
    total: int  # --max-parked
    per_uid: int  # --max-parked-per-uid
    per_client: int  # --max-parked-per-client

    def check(
        self, what: str, registered: Iterable[tuple[int | None, int]], holder: Holder, pid: int
    ) -> None:
        """Refuse one more ``what`` (say "parked engines") for ``holder`` and process ``pid``,
        given the (holder uid, pid) of every registration kept."""
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
        mine = sum(1 for _, other in kept if other == pid)
        if mine >= self.per_client:
            raise TooManyClientParkedError(
                f"process {pid} has {mine} {what}", client_pid=pid, limit=self.per_client
            )

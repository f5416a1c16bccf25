"""Leases: who holds which model's memory, until when.

A lease names its client PID; the reaper ends leases whose PID is gone (and whose start time no
longer matches, so a reused PID does not keep a dead engine's lease alive) as well as those past
their expiry. Lease ids start with the daemon's boot id, so a lease from before a restart is
recognised as such rather than reported as unknown.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from protocol.errors import DaemonRestartedError, LeaseExpiredError, LeaseNotFoundError
from protocol.schemas.leases import LeaseInfo
from service.memory.devices import process_alive, process_start

_REMEMBERED_ENDINGS = 10_000


class LeaseEnd(str, enum.Enum):
    released = "released"
    expired = "expired"
    reaped = "reaped"  # client process gone


@dataclass
class Lease:
    id: str
    model: str
    tp_rank: int
    tp_size: int
    client_pid: int
    pid_start: int | None  # None: the PID is not visible here (another PID namespace)
    granted_at: float
    expires_at: float
    ttl_s: float
    renewals: int = 0

    def info(self, boot_id: str) -> LeaseInfo:
        return LeaseInfo(
            id=self.id,
            model=self.model,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            client_pid=self.client_pid,
            pid_watched=self.pid_start is not None,
            boot_id=boot_id,
            granted_at=self.granted_at,
            expires_at=self.expires_at,
            ttl_s=self.ttl_s,
            renewals=self.renewals,
        )


class LeaseTable:
    """Active leases and the recently ended ones. Callers hold the daemon lock."""

    def __init__(
        self, boot_id: str, on_end: Callable[[Lease, LeaseEnd], None] | None = None
    ) -> None:
        self.boot_id = boot_id
        self.on_end = on_end
        self.active: dict[str, Lease] = {}
        self.ended: OrderedDict[str, LeaseEnd] = OrderedDict()

    def add(
        self, model: str, tp_rank: int, tp_size: int, client_pid: int, ttl_s: float, now: float
    ) -> Lease:
        started = process_start(client_pid)
        lease = Lease(
            id=f"{self.boot_id}.{secrets.token_hex(12)}",
            model=model,
            tp_rank=tp_rank,
            tp_size=tp_size,
            client_pid=client_pid,
            pid_start=started[0] if started else None,
            granted_at=now,
            expires_at=now + ttl_s,
            ttl_s=ttl_s,
        )
        self.active[lease.id] = lease
        return lease

    def get(self, lease_id: str, now: float) -> Lease:
        lease = self.active.get(lease_id)
        if lease is not None and now > lease.expires_at:
            self.end(lease_id, LeaseEnd.expired)
            lease = None
        if lease is not None:
            return lease
        ending = self.ended.get(lease_id)
        if ending in (LeaseEnd.expired, LeaseEnd.reaped):
            raise LeaseExpiredError(f"lease {lease_id} ended: {ending.value}", reason=ending.value)
        if not lease_id.startswith(f"{self.boot_id}."):
            raise DaemonRestartedError(
                "the lease was granted by an earlier run of the daemon; lease again",
                boot_id=self.boot_id,
            )
        raise LeaseNotFoundError(f"no active lease {lease_id}")

    def renew(self, lease_id: str, ttl_s: float | None, now: float) -> Lease:
        lease = self.get(lease_id, now)
        if ttl_s is not None:
            lease.ttl_s = ttl_s
        lease.expires_at = now + lease.ttl_s
        lease.renewals += 1
        return lease

    def end(self, lease_id: str, how: LeaseEnd) -> Lease | None:
        lease = self.active.pop(lease_id, None)
        if lease is not None:
            self.ended[lease_id] = how
            while len(self.ended) > _REMEMBERED_ENDINGS:
                self.ended.popitem(last=False)
            if self.on_end is not None:
                self.on_end(lease, how)
        return lease

    def count(self, model: str | None = None) -> int:
        if model is None:
            return len(self.active)
        return sum(1 for lease in self.active.values() if lease.model == model)

    def sweep(self, now: float) -> list[tuple[Lease, LeaseEnd]]:
        """End leases past expiry or whose client is gone; returns what ended and why."""
        ended = []
        for lease in list(self.active.values()):
            if now > lease.expires_at:
                how = LeaseEnd.expired
            elif lease.pid_start is not None and not process_alive(
                lease.client_pid, lease.pid_start
            ):
                how = LeaseEnd.reaped
            else:
                continue
            self.end(lease.id, how)
            ended.append((lease, how))
        return ended

    @staticmethod
    def now() -> float:
        return time.time()

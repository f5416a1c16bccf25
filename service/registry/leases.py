"""Leases: who holds which model's memory, until when.

A lease records its holder as the kernel proved it (``Lease.holder``: see
:mod:`service.registry.lease_holders`); the reaper ends leases whose holder process is gone (and
whose start time no longer matches, so a reused PID does not keep a dead engine's lease alive) as
well as those past their expiry. Lease ids start with the daemon's boot id, so a lease from
before a restart is recognised as such rather than reported as unknown.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.errors import DaemonRestartedError, LeaseExpiredError, LeaseNotFoundError
from protocol.logsafe import get_logger
from protocol.schemas.leases import LeaseInfo
from service.memory.devices import process_alive
from service.registry.lease_holders import FLAT_FIELDS, Holder
from service.registry.run_ids import from_this_run, new_id

log = get_logger("service.daemon")  # the name operators filter the daemon's lines by

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
    holder: Holder  # its caller, as the kernel proved it
    granted_at: float
    expires_at: float
    ttl_s: float
    renewals: int = 0
    # Presented with the lease id to the handle socket: only the grant's receiver knows it.
    secret: str = ""
    # A warm standby's lease, until its standby is released: it serves nobody yet.
    standby_group: str | None = None

    @property
    def serving(self) -> bool:
        return self.standby_group is None

    @property
    def client_pid(self) -> int:
        """The pid the request named (what ``LeaseInfo.client_pid`` shows)."""
        return self.holder.named_pid

    def record(self) -> dict[str, object]:
        """Every field, the holder's spelled flat (what the keeper keeps: ``KeptLease``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["holder"]
        return fields | self.holder.fields()

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Lease:
        """The lease :meth:`record` wrote."""
        rest = {name: value for name, value in record.items() if name not in FLAT_FIELDS}
        return cls(**rest, holder=Holder.from_fields(record))

    def info(self, boot_id: str) -> LeaseInfo:
        return LeaseInfo(
            id=self.id,
            model=self.model,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            **self.holder.fields(),
            pid_watched=self.holder.pid_start is not None,
            boot_id=boot_id,
            granted_at=self.granted_at,
            expires_at=self.expires_at,
            ttl_s=self.ttl_s,
            renewals=self.renewals,
            standby_group=self.standby_group,
        )


class SweptAlong(Protocol):
    """What else the sweep ends: registrations that expire and watch client processes."""

    def expire(self, now: float) -> object: ...

    def watched(self) -> Iterable[tuple[int, int]]: ...

    def process_gone(self, pid: int, start: int, now: float) -> object: ...


class LeaseTable:
    """Active leases and the recently ended ones. Callers hold the daemon's ``lock``; the sweep
    takes it itself, as it must let go of it while it reads ``/proc``.

    Every operation costs O(log n) at most: expiries sit in a heap (a renewal pushes a new
    entry; stale ones are skipped when they surface), leases are counted per model, per holder
    process and per holder user as they come and go, and the reaper checks each distinct holder
    process once per sweep, not each lease.
    """

    def __init__(
        self,
        boot_id: str,
        lock: threading.RLock | None = None,
        on_end: Callable[[Lease, LeaseEnd], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.boot_id = boot_id
        self.clock = clock  # the registry's one clock (the lease desk's)
        self.lock = lock or threading.RLock()
        self.on_end = on_end
        self.active: dict[str, Lease] = {}
        self.ended: OrderedDict[str, LeaseEnd] = OrderedDict()
        self._expiries: list[tuple[float, str]] = []
        self._by_model: Counter[str] = Counter()
        self._by_uid: Counter[int | None] = Counter()
        # Holder PID -> its leases. All share one process start time: a lease from a reused
        # PID ends the earlier process's leases first (see add).
        self._by_pid: dict[int, set[str]] = {}
        # Standby groups released (with their user): a lease taken under one later serves.
        self._promoted: OrderedDict[tuple[str, int | None], None] = OrderedDict()

    def add(
        self,
        model: str,
        tp_rank: int,
        tp_size: int,
        ttl_s: float,
        now: float,
        holder: Holder,
        standby_group: str | None = None,
    ) -> Lease:
        """A lease for ``holder``, proven (:func:`~service.registry.lease_holders.prove_holder`)
        before the caller took the daemon's lock: no grant waits on another's ``/proc`` read.
        With ``standby_group``, a warm standby's: not serving until :meth:`promote`."""
        if holder.pid is not None:
            known = self._start_of(holder.pid)
            if known is not None and holder.pid_start is not None and known != holder.pid_start:
                self.reap(holder.pid, known)  # the PID was reused: its earlier process is gone
        lease = Lease(
            id=new_id(self.boot_id),
            model=model,
            tp_rank=tp_rank,
            tp_size=tp_size,
            holder=holder,
            granted_at=now,
            expires_at=now + ttl_s,
            ttl_s=ttl_s,
            secret=secrets.token_urlsafe(18),  # 144 bits
            standby_group=None if (standby_group, holder.uid) in self._promoted else standby_group,
        )
        self._insert(lease)
        return lease

    def promote(self, group: str, holder_uid: int | None) -> list[Lease]:
        """The warm standby of ``group`` (of user ``holder_uid``) was released: its leases serve
        from now on. Another user's leases naming the group are left as they are."""
        self._promoted[(group, holder_uid)] = None
        while len(self._promoted) > _REMEMBERED_ENDINGS:
            self._promoted.popitem(last=False)
        promoted = []
        for lease in self.active.values():
            if lease.standby_group == group and lease.holder.uid == holder_uid:
                lease.standby_group = None
                promoted.append(lease)
        return promoted

    def adopt(self, lease: Lease, now: float) -> Lease:
        """Take over a lease an earlier daemon granted (same id and secret), with a full TTL
        from ``now``: its engine could not renew while no daemon answered."""
        lease.expires_at = max(lease.expires_at, now + lease.ttl_s)
        self._insert(lease)
        return lease

    def _insert(self, lease: Lease) -> None:
        self.active[lease.id] = lease
        heapq.heappush(self._expiries, (lease.expires_at, lease.id))
        self._by_model[lease.model] += 1
        self._by_uid[lease.holder.uid] += 1
        if lease.holder.pid is not None:
            self._by_pid.setdefault(lease.holder.pid, set()).add(lease.id)

    def _start_of(self, pid: int) -> int | None:
        ids = self._by_pid.get(pid)
        return self.active[next(iter(ids))].holder.pid_start if ids else None

    def get(self, lease_id: str, now: float) -> Lease:
        lease = self.active.get(lease_id)
        if lease is not None and now > lease.expires_at:
            self.end(lease_id, LeaseEnd.expired)
            lease = None
        if lease is not None:
            return lease
        ending = self.ended.get(lease_id)
        if ending in (LeaseEnd.expired, LeaseEnd.reaped):
            raise LeaseExpiredError(f"lease {lease_id} ended: {ending.value}", reason=ending)
        if not from_this_run(lease_id, self.boot_id):
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
        heapq.heappush(self._expiries, (lease.expires_at, lease.id))
        return lease

    def end(self, lease_id: str, how: LeaseEnd) -> Lease | None:
        lease = self.active.pop(lease_id, None)
        if lease is not None:
            self._by_model[lease.model] -= 1
            if not self._by_model[lease.model]:
                del self._by_model[lease.model]
            self._by_uid[lease.holder.uid] -= 1
            if not self._by_uid[lease.holder.uid]:
                del self._by_uid[lease.holder.uid]
            ids = self._by_pid.get(lease.holder.pid) if lease.holder.pid is not None else None
            if ids is not None:
                ids.discard(lease_id)
                if not ids:
                    del self._by_pid[lease.holder.pid]  # type: ignore[arg-type]
            self.ended[lease_id] = how
            while len(self.ended) > _REMEMBERED_ENDINGS:
                self.ended.popitem(last=False)
            if self.on_end is not None:
                self.on_end(lease, how)
        return lease

    def count(self, model: str | None = None) -> int:
        if model is None:
            return len(self.active)
        return self._by_model.get(model, 0)

    def serving(self, model: str) -> bool:
        """Whether an engine serves ``model``: a lease on it that is not a sleeping standby's."""
        if not self._by_model.get(model):
            return False
        return any(x.model == model and x.serving for x in self.active.values())

    def count_client(self, pid: int) -> int:
        """Active leases held by process ``pid``."""
        return len(self._by_pid.get(pid, ()))

    def count_user(self, uid: int | None) -> int:
        """Active leases held by user ``uid``."""
        return self._by_uid.get(uid, 0)

    def expire(self, now: float) -> list[tuple[Lease, LeaseEnd]]:
        """End leases past their expiry: O(log n) for each one ended or renewed since."""
        ended = []
        heap = self._expiries
        while heap and heap[0][0] < now:
            _, lease_id = heapq.heappop(heap)
            lease = self.active.get(lease_id)
            if lease is None or lease.expires_at >= now:
                continue  # ended already, or renewed (a later entry stands for it)
            self.end(lease_id, LeaseEnd.expired)
            ended.append((lease, LeaseEnd.expired))
        if len(heap) > 4 * len(self.active) + 1024:  # renewals left many stale entries
            self._expiries = [(x.expires_at, x.id) for x in self.active.values()]
            heapq.heapify(self._expiries)
        return ended

    def watched(self) -> list[tuple[int, int]]:
        """(PID, start time) of every client the daemon can watch: one entry per process."""
        watched = []
        for pid in self._by_pid:
            start = self._start_of(pid)
            if start is not None:
                watched.append((pid, start))
        return watched

    def watched_along(self, *others: SweptAlong) -> set[tuple[int, int]]:
        """(PID, start) of every process whose end the sweep acts on: the lease holders and
        those ``others`` watch."""
        with self.lock:
            watched = set(self.watched())
            for other in others:
                watched.update(other.watched())
            return watched

    def reap(self, pid: int, start: int) -> list[tuple[Lease, LeaseEnd]]:
        """End every lease of the (dead) process ``pid`` that started at ``start``."""
        ended = []
        for lease_id in list(self._by_pid.get(pid, ())):
            if self.active[lease_id].holder.pid_start != start:
                continue  # a lease of the process that now has this PID
            lease = self.end(lease_id, LeaseEnd.reaped)
            if lease is not None:
                ended.append((lease, LeaseEnd.reaped))
        return ended

    def sweep(self, now: float, *others: SweptAlong) -> list[tuple[Lease, LeaseEnd]]:
        """End leases past their expiry and those whose client is gone, and tell ``others``
        (engines waiting on the daemon) the same: the reaper's one sweep, blocking (it reads
        ``/proc``; run it in a thread). The lock is held for the heap pops and the PID list, and
        again for the reaping, never across the ``/proc`` reads, so grants do not wait on them.
        A dead client's leases end before ``others`` hear of it, so the ranks it held free the
        engines parked behind it."""
        with self.lock:
            ended = self.expire(now)
            for other in others:
                other.expire(now)
            watched = self.watched_along(*others)
        dead = [(pid, start) for pid, start in sorted(watched) if not process_alive(pid, start)]
        if dead:
            with self.lock:
                for pid, start in dead:
                    reaped = self.reap(pid, start)
                    ended += reaped
                    if reaped:
                        log.info("client pid %d is gone: reaped its %d lease(s)", pid, len(reaped))
                    for other in others:
                        other.process_gone(pid, start, now)
        return ended

    def now(self) -> float:
        return self.clock()

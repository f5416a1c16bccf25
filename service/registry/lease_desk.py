"""The lease desk: the one place that grants, renews and releases what engines hold of the
daemon (leases, parked engines, start-up slot tickets), proves their holders, and says what
follows when one ends.

Every request that ties something to its caller comes here: the holder is proven first,
outside the daemon's lock (:func:`~service.registry.lease_holders.prove_holder` reads
``/proc``), then the registry decides under the lock. The desk owns the registry's clock (one
``clock``, injectable), so no caller passes a time in. A lease's end, however it comes
(released, expired, reaped), fans out from :meth:`LeaseDesk._lease_ended`: its counter, the
parked engines waiting for its model, the warm standby it belonged to, and the keeper.

The routes call one method each; the daemon builds the desk with what it needs and nothing is
set on it afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from protocol.errors import LeaseNotYoursError, ModelInUseError
from protocol.logsafe import get_logger
from protocol.schemas.leases import LeaseInfo, LeaseRequest
from protocol.schemas.manifest import ArenaDescriptor, HandleAccess
from protocol.schemas.models import ModelInfo
from protocol.schemas.parking import ParkedEngine, ParkRequest, ReleaseCause
from protocol.schemas.startup_slots import SlotRequest, SlotTicket
from service.memory.devices import collect_ipc_handles
from service.metrics import Metrics
from service.registry.compatibility import check_request_fits
from service.registry.exit_watch import ExitWatch
from service.registry.grant import Grant
from service.registry.lease_holders import Caller, prove_holder
from service.registry.lease_limits import LeaseLimits
from service.registry.leases import Lease, LeaseEnd, LeaseTable
from service.registry.model_table import ModelTable
from service.registry.models import ModelRecord
from service.registry.parking import ParkingLot
from service.registry.startup_slots import StartupSlots, Ticket
from service.registry.waiting_rules import Changes, RoomWiring, WaitingCaps
from service.settings import DaemonSettings

log = get_logger("service.daemon")  # the name operators filter the daemon's lines by

Clock = Callable[[], float]


class LeaseKeeper(Protocol):
    """What the desk tells whatever keeps leases beyond this process (the keeper's custody)."""

    def access(self, lease: Lease) -> HandleAccess | None: ...

    def lease_granted(self, lease: Lease) -> None: ...

    def lease_ended(self, lease: Lease) -> None: ...

    def model_gone(self, record: ModelRecord) -> None: ...


class LeaseDesk:
    def __init__(
        self,
        boot_id: str,
        lock: threading.RLock,
        settings: DaemonSettings,
        metrics: Metrics,
        models: ModelTable,
        keeper: LeaseKeeper,
        clock: Clock = time.time,
    ) -> None:
        self.boot_id = boot_id
        self.lock = lock
        self.clock = clock
        self.metrics = metrics
        self.models = models
        self.keeper = keeper
        self.limits = LeaseLimits(settings)
        self.leases = LeaseTable(boot_id, lock, on_end=self._lease_ended, clock=clock)
        # Who waits on a parked engine's or a ticket's change (the API's long-polls).
        self.changes = Changes()
        caps = WaitingCaps(
            settings.max_parked, settings.max_parked_per_uid, settings.max_parked_per_client
        )
        rooms = RoomWiring(boot_id, lock, caps, on_change=self.changes)
        self.parking = ParkingLot(
            rooms,
            on_release=lambda cause: metrics.parked_releases.labels(cause=cause.value).inc(),
            known_model=models.get,
            serving=self.leases.serving,
            promote=self._promote,
        )
        self.startup_slots = StartupSlots(
            rooms,
            settings.startup_slot_hold_s,
            on_reclaim=lambda why: metrics.startup_slot_reclaims.labels(why=why).inc(),
        )
        # Sweeps the moment a watched process ends (a serving engine killed: its standby wakes).
        self.exit_watch = ExitWatch(self.watched_processes, self.sweep)

    # --- leases --------------------------------------------------------------------------------

    def grant(self, req: LeaseRequest, caller: Caller) -> Grant:
        """A lease for ``caller``, tied to its holder as the kernel proved it; the arena is
        exported for it, or the lease is taken back."""
        holder = prove_holder(caller, req.client_pid)  # /proc: outside the lock
        with self.lock:
            record = self.models.get(req.model)
            self.models.fail_lost_arenas(record)
            record.require_ready()
            check_request_fits(record, req)
            ttl = self.limits.ttl_for(req.ttl_s)
            self.limits.check_room(self.leases, holder)
            rank = record.ranks[req.tp_rank]
            lease = self.leases.add(
                req.model, req.tp_rank, req.tp_size, ttl, self.clock(), holder, req.standby_group
            )
            try:
                handle = rank.arena.export(self.keeper.access(lease))  # fresh for every lease
            except BaseException:
                self.leases.end(lease.id, LeaseEnd.released)
                raise
            self.keeper.lease_granted(lease)
            record.touch()
            info = lease.info(self.boot_id)
        self.exit_watch.poke()  # watch its holder from now on
        self.metrics.leases_granted.labels(via="request").inc()
        arena = ArenaDescriptor(index=0, nbytes=rank.arena.nbytes, handle=handle)
        return Grant(info, rank, [arena], req.known_layout != rank.manifest.layout_digest)

    def _held(self, lease_id: str, caller: Caller) -> Lease:
        """The active lease ``lease_id``, if ``caller`` may touch it. Caller holds the lock."""
        lease = self.leases.get(lease_id, self.clock())
        if not caller.may_manage(lease.holder.uid):
            raise LeaseNotYoursError(f"lease {lease_id} is held by another user", lease=lease_id)
        return lease

    def lease(self, lease_id: str, caller: Caller) -> LeaseInfo:
        with self.lock:
            return self._held(lease_id, caller).info(self.boot_id)

    def list_leases(self, caller: Caller) -> list[LeaseInfo]:
        """The active leases ``caller`` may touch (every one for a trusted caller)."""
        with self.lock:
            self.leases.expire(self.clock())
            return [
                lease.info(self.boot_id)
                for lease in self.leases.active.values()
                if caller.may_manage(lease.holder.uid)
            ]

    def renew(self, lease_id: str, ttl_s: float | None, caller: Caller) -> LeaseInfo:
        if ttl_s is not None:
            self.limits.checked_ttl(ttl_s)
        with self.lock:
            self._held(lease_id, caller)
            return self.leases.renew(lease_id, ttl_s, self.clock()).info(self.boot_id)

    def release(self, lease_id: str, caller: Caller) -> None:
        with self.lock:
            self._held(lease_id, caller)
            self.leases.end(lease_id, LeaseEnd.released)

    def _lease_ended(self, lease: Lease, how: LeaseEnd) -> None:
        """Every lease's end, however it came (released, expired on access or by the reaper,
        reaped), is counted here once and told to whoever it concerns."""
        counters = {
            LeaseEnd.released: self.metrics.leases_released,
            LeaseEnd.expired: self.metrics.leases_expired,
            LeaseEnd.reaped: self.metrics.leases_reaped,
        }
        counters[how].inc()
        record = self.models.records.get(lease.model)
        if record is not None:
            record.touch()  # idle from now on (the eviction order)
        now = self.clock()
        if lease.standby_group is not None and how is LeaseEnd.reaped:
            self.parking.standby_engine_gone(lease.standby_group, lease.holder.uid, now)
        if lease.serving:  # a sleeping standby's lease served nobody: no one replaces it
            self.parking.lease_ended(
                lease.model,
                lease.tp_rank,
                lease.tp_size,
                lease.holder.pid,  # the process pid_start is of (the one watched)
                lease.holder.pid_start,
                process_gone=how is LeaseEnd.reaped,
                now=now,
            )
        self.keeper.lease_ended(lease)
        if how is LeaseEnd.expired:  # reaped ones are logged once per dead client (sweep)
            log.info(
                "lease %s on %s %s (pid %d)", lease.id, lease.model, how.value, lease.client_pid
            )

    def _promote(self, group: str, holder_uid: int | None) -> None:
        """A warm standby was released (under the lock): its leases serve from now on, and the
        keeper records them so."""
        for lease in self.leases.promote(group, holder_uid):
            self.keeper.lease_granted(lease)

    # --- parked engines ------------------------------------------------------------------------

    def park(self, req: ParkRequest, caller: Caller) -> ParkedEngine:
        holder = prove_holder(caller, req.client_pid)  # /proc: outside the lock
        return self.parking.park(req, self.clock(), holder).info(self.boot_id)

    def parked(self, caller: Caller) -> list[ParkedEngine]:
        return [e.info(self.boot_id) for e in self.parking.entries(caller)]

    def parked_engine(self, parked_id: str, caller: Caller, wait_s: float = 0.0) -> ParkedEngine:
        """One parked engine, kept for it ``wait_s`` longer (it long-polls)."""
        entry = self.parking.get(parked_id, self.clock(), caller, wait_s)
        return entry.info(self.boot_id)

    def withdraw(self, parked_id: str, caller: Caller) -> None:
        self.parking.withdraw(parked_id, caller)

    def release_parked(self, parked_id: str, caller: Caller) -> list[ParkedEngine]:
        """An operator releases the engine ``parked_id`` belongs to (every rank)."""
        released = self.parking.release(parked_id, ReleaseCause.operator, self.clock(), caller)
        return [e.info(self.boot_id) for e in released]

    def release_oldest(self, model: str, tp_size: int | None, caller: Caller) -> list[ParkedEngine]:
        """An operator releases the oldest engine parked in full for ``model``."""
        released = self.parking.release_oldest(
            model, tp_size, ReleaseCause.operator, self.clock(), caller
        )
        return [e.info(self.boot_id) for e in released]

    def cancel_parked(self, parked_id: str, caller: Caller) -> list[ParkedEngine]:
        return [e.info(self.boot_id) for e in self.parking.cancel(parked_id, self.clock(), caller)]

    # --- start-up slots ------------------------------------------------------------------------

    def take_slot(self, req: SlotRequest, caller: Caller) -> SlotTicket:
        holder = prove_holder(caller, req.client_pid)  # /proc: outside the lock
        return self._shown(self.startup_slots.take(req, self.clock(), holder))

    def tickets(self, caller: Caller) -> list[SlotTicket]:
        return [self._shown(t) for t in self.startup_slots.entries(caller)]

    def ticket(self, ticket_id: str, caller: Caller, wait_s: float = 0.0) -> SlotTicket:
        """One ticket; a waiting one is kept ``wait_s`` longer (it long-polls)."""
        return self._shown(self.startup_slots.get(ticket_id, self.clock(), caller, wait_s))

    def give_back(self, ticket_id: str, caller: Caller) -> None:
        self.startup_slots.give_back(ticket_id, self.clock(), caller)

    def _shown(self, ticket: Ticket) -> SlotTicket:
        return ticket.info(self.boot_id, self.startup_slots.ahead(ticket))

    # --- models, as leases see them ------------------------------------------------------------

    def model_info(self, record: ModelRecord) -> ModelInfo:
        """``record`` with its active leases and parked engines (a lost arena fails it first)."""
        with self.lock:
            self.models.fail_lost_arenas(record)
            info = record.info(self.leases.count(record.id))
            return info.model_copy(update={"parked": self.parking.summary(record.id)})

    def unload(self, model_id: str) -> None:
        """Forget a model and free its arenas; refused while any lease on it is active."""
        self.sweep()
        with self.lock:
            self.models.get(model_id)
            active = self.leases.count(model_id)
            if active:
                raise ModelInUseError(
                    f"model {model_id!r} has {active} active lease(s)",
                    model=model_id,
                    active_leases=active,
                )
            record = self.models.remove(model_id)
            self.keeper.model_gone(record)
        record.release()  # outside the lock: unmapping gigabytes takes a while
        log.info("unloaded %s", model_id)

    # --- the sweep -----------------------------------------------------------------------------

    def watched_processes(self) -> set[tuple[int, int]]:
        """(PID, start) of every process whose end the sweep acts on: lease holders, parked
        engines and start-up slot holders."""
        return self.leases.watched_along(self.parking, self.startup_slots)

    def sweep(self) -> None:
        """End expired leases and those whose client died, and forget waiting engines that are
        gone (the reaper's periodic task, and the exit watch's)."""
        if self.leases.sweep(self.clock(), self.parking, self.startup_slots):
            collect_ipc_handles()

    def waiting_counts(self) -> tuple[int, dict[str, int]]:
        """Parked engines still waiting, and start-up slot tickets by state (the gauges)."""
        return self.parking.count_waiting(), self.startup_slots.counts()

    def start(self) -> None:
        self.exit_watch.start()

    def stop(self) -> None:
        self.exit_watch.stop()

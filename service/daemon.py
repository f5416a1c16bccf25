"""The daemon: one object the API talks to, wiring the registry's parts behind one lock.

Routes call its methods and nothing else (not its settings, not its metrics). The work lives in
the registry: the model table (``registry/model_table.py``: loads, startup models, readiness,
lost arenas; ``ModelRecord.fail`` is the one way a model fails), path policy
(``registry/path_policy.py``), the grant compatibility check (``registry/compatibility.py``), lease
limits (``registry/lease_limits.py``), the lease table and its sweep (``registry/leases.py``) and
the scrub (``registry/scrub.py``); the daemon counts what they report. Every decision that could
race (granting a lease on a model that is being unloaded, unloading a model a lease was just
granted on) happens under ``self.lock``, so an arena is never released while a lease on it is
active.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import generate_latest
from pydantic import SecretStr

from modelopt_fp8.checkpoint.opened import PathPolicy
from protocol.errors import LeaseNotYoursError, ModelInUseError, WeightCacheError
from protocol.logsafe import get_logger
from protocol.schemas.health import Health, Readiness
from protocol.schemas.inventory import Inventory
from protocol.schemas.leases import LeaseInfo, LeaseRequest
from protocol.schemas.manifest import ArenaDescriptor, DaemonIdentity
from protocol.schemas.models import ModelInfo
from protocol.version import PROTOCOL_VERSION, __version__
from service.keeper.custody import Custody
from service.memory.devices import collect_ipc_handles, device_infos, use_plain_cuda_allocations
from service.memory.shm import ArenaDir, remove_stale_files
from service.metrics import Metrics, StateSnapshot
from service.registry.compatibility import check_request_fits
from service.registry.donations import Donations
from service.registry.exit_watch import ExitWatch
from service.registry.grant import Grant
from service.registry.lease_holders import Caller, prove_holder
from service.registry.lease_limits import LeaseLimits
from service.registry.leases import Lease, LeaseEnd, LeaseTable
from service.registry.model_table import ModelTable
from service.registry.models import ModelRecord
from service.registry.path_policy import allowed_checkpoint_path, api_load_policy
from service.registry.scrub import scrub
from service.registry.waiting import WaitingEngines
from service.settings import DaemonSettings

log = get_logger(__name__)

# Blocking work the app runs in a worker thread every so many seconds: (interval, work, what).
PeriodicTask = tuple[float, Callable[[], object], str]


class Daemon:
    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.boot_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.lock = threading.RLock()
        self.metrics = Metrics(
            self.metrics_snapshot,
            {"version": __version__, "protocol_version": str(PROTOCOL_VERSION)},
        )
        self.models = ModelTable(settings, self.lock, on_loaded=self.metrics.load_seconds.observe)
        self.leases = LeaseTable(self.boot_id, self.lock, on_end=self._lease_ended)
        self.limits = LeaseLimits(settings)
        # Engines waiting: parked ones and warm standbys (released when one serving their
        # model ends) and those queued for their GPU's start-up slot; the routes use these two
        # registries directly.
        self.waiting = WaitingEngines(
            self.boot_id,
            self.lock,
            settings,
            self.metrics,
            self.models.get,
            self.leases.serving,
            self._promote,
        )
        self.parking, self.startup_slots = self.waiting.parking, self.waiting.startup_slots
        # The handle socket, the keeper and adoption: what lets arenas outlive this process.
        self.custody = Custody(
            settings, self.boot_id, self.lock, self.models, self.leases, self.count_refusal
        )
        self.models.on_ready = self.custody.model_ready
        self.models.on_gone = self.custody.model_gone
        self.identity = DaemonIdentity(
            boot_id=self.boot_id,
            protocol_version=PROTOCOL_VERSION,
            weight_cache_version=__version__,
            torch_version=torch.__version__,
        )
        self.arena_dir: ArenaDir | None = None
        # Models engines donate (their vLLM's processing, kept and lent here); the routes use
        # this registry directly.
        self.donations = Donations(
            self.models,
            self.lock,
            settings.allow_token_donations,
            self.identity,
            lambda: self.arena_dir,
        )
        # Sweeps the moment a watched process ends (a serving engine killed: its standby wakes).
        self.exit_watch = ExitWatch(self.watched_processes, self.sweep)

    @property
    def startup_failure(self) -> tuple[str, WeightCacheError] | None:
        """The first startup model that failed to load (unless ``keep_going``), with why."""
        return self.models.startup_failure

    def on_startup_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when a startup model fails and ``keep_going`` is off."""
        self.models.on_startup_failure = callback

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Make the private arena directory, clean up after dead daemons, and start loading
        the models asked for at start."""
        root = self.settings.shm_dir
        if root.is_dir():
            self.arena_dir = ArenaDir.prepare(root, self.settings.shm_group)
        else:
            log.warning("no shared-memory directory %s: CPU arenas cannot be made", root)
        use_plain_cuda_allocations()
        self.custody.start(self.arena_dir)  # adopts what a keeper held, before the sweep
        self.metrics.leases_granted.labels(via="keeper").inc(self.custody.leases_taken_over)
        if self.arena_dir is not None:
            stale = remove_stale_files(root) + self.arena_dir.remove_stale()  # earlier layout too
            for path in stale:
                log.info("removed stale shared-memory arena %s", path)
        self.exit_watch.start()
        self.models.load_at_start(
            self.settings.startup_models(),
            self.settings.tp_size,
            self.arena_dir,
            self.identity,
            adopted=self.custody.adopted_as,
        )

    def shutdown(self) -> None:
        """Stop; with a keeper, leave the arenas to it (the next daemon takes them over)."""
        self.exit_watch.stop()
        if self.custody.keeps:
            self.models.detach_all()
        else:
            self.models.release_all()
        self.custody.shutdown()
        if self.arena_dir is not None:
            self.arena_dir.close()

    def periodic_tasks(self) -> list[PeriodicTask]:
        """What the app runs beside the API: the lease sweep, and the scrub when enabled."""
        tasks: list[PeriodicTask] = [(self.settings.reaper_interval_s, self.sweep, "lease sweep")]
        if self.settings.scrub_interval_s > 0:
            tasks.append((self.settings.scrub_interval_s, self.scrub, "arena scrub"))
        return tasks

    # --- models --------------------------------------------------------------------------------

    def load(self, path: Path, model_id: str | None, tp_size: int) -> ModelRecord:
        """Register a model asked for over the API and load it in a worker thread (returns at
        once); it reads only below the allowed roots, and is refused past the caps on models and
        on loads at once before it opens anything."""
        self.models.check_room()
        allowed = api_load_policy(self.settings.allowed_roots, self.settings.follow_symlinks)
        path = allowed_checkpoint_path(path, allowed)
        return self.models.start_load(
            path,
            model_id,
            tp_size,
            allowed or PathPolicy(),
            self.arena_dir,
            self.identity,
            limited=True,
        )

    def model(self, model_id: str) -> ModelRecord:
        return self.models.get(model_id)

    def model_info(self, record: ModelRecord) -> ModelInfo:
        with self.lock:
            self.models.fail_lost_arenas(record)
            return self._info(record)

    def list_models(self) -> list[ModelInfo]:
        with self.lock:
            records = list(self.models.records.values())
            for record in records:
                self.models.fail_lost_arenas(record)
            return [self._info(r) for r in records]

    def _info(self, record: ModelRecord) -> ModelInfo:
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
            self.custody.model_gone(record)
        record.release()  # outside the lock: unmapping gigabytes takes a while
        log.info("unloaded %s", model_id)

    # --- leases --------------------------------------------------------------------------------

    def grant(self, req: LeaseRequest, caller: Caller | None = None) -> Grant:
        """A lease for ``caller`` (default: this process), tied to its holder as the kernel
        proved it (:mod:`service.registry.lease_holders`)."""
        holder = prove_holder(caller or Caller.local(), req.client_pid)  # /proc: outside the lock
        with self.lock:
            record = self.models.get(req.model)
            self.models.fail_lost_arenas(record)
            record.require_ready()
            check_request_fits(record, req)
            ttl = self.limits.ttl_for(req.ttl_s)
            self.limits.check_room(self.leases, holder)
            rank = record.ranks[req.tp_rank]
            lease = self.leases.add(
                req.model,
                req.tp_rank,
                req.tp_size,
                req.client_pid,
                ttl,
                self.leases.now(),
                holder,
                req.standby_group,
            )
            try:
                handle = rank.arena.export(self.custody.access(lease))  # fresh for every lease
            except BaseException:
                self.leases.end(lease.id, LeaseEnd.released)
                raise
            self.custody.lease_granted(lease)
            info = lease.info(self.boot_id)
        self.exit_watch.poke()  # watch its holder from now on
        self.metrics.leases_granted.labels(via="request").inc()
        arena = ArenaDescriptor(index=0, nbytes=rank.arena.nbytes, handle=handle)
        return Grant(info, rank, [arena], req.known_layout != rank.manifest.layout_digest)

    def observe_grant_seconds(self, seconds: float) -> None:
        """How long a grant took the API, its rendering included (a histogram)."""
        self.metrics.lease_seconds.observe(seconds)

    def _held(self, lease_id: str, caller: Caller) -> Lease:
        """The active lease ``lease_id``, if ``caller`` may touch it. Caller holds the lock."""
        lease = self.leases.get(lease_id, self.leases.now())
        if not caller.may_manage(lease.holder_uid):
            raise LeaseNotYoursError(f"lease {lease_id} is held by another user", lease=lease_id)
        return lease

    def lease(self, lease_id: str, caller: Caller) -> LeaseInfo:
        with self.lock:
            return self._held(lease_id, caller).info(self.boot_id)

    def list_leases(self, caller: Caller) -> list[LeaseInfo]:
        """The active leases ``caller`` may touch (every one for a trusted caller)."""
        with self.lock:
            self.leases.expire(self.leases.now())
            return [
                lease.info(self.boot_id)
                for lease in self.leases.active.values()
                if caller.may_manage(lease.holder_uid)
            ]

    def renew(self, lease_id: str, ttl_s: float | None, caller: Caller) -> LeaseInfo:
        if ttl_s is not None:
            self.limits.checked_ttl(ttl_s)
        with self.lock:
            self._held(lease_id, caller)
            return self.leases.renew(lease_id, ttl_s, self.leases.now()).info(self.boot_id)

    def release(self, lease_id: str, caller: Caller) -> None:
        with self.lock:
            self._held(lease_id, caller)
            self.leases.end(lease_id, LeaseEnd.released)

    def _lease_ended(self, lease: Lease, how: LeaseEnd) -> None:
        """Every lease's end, however it came (released, expired on access or by the reaper,
        reaped), is counted here once."""
        counters = {
            LeaseEnd.released: self.metrics.leases_released,
            LeaseEnd.expired: self.metrics.leases_expired,
            LeaseEnd.reaped: self.metrics.leases_reaped,
        }
        counters[how].inc()
        if lease.standby_group is not None and how is LeaseEnd.reaped:
            self.parking.standby_engine_gone(
                lease.standby_group, lease.holder_uid, self.leases.now()
            )
        if lease.serving:  # a sleeping standby's lease served nobody: no one replaces it
            self.parking.lease_ended(
                lease.model,
                lease.tp_rank,
                lease.tp_size,
                lease.holder_pid,  # the process pid_start is of (the one watched)
                lease.pid_start,
                process_gone=how is LeaseEnd.reaped,
                now=self.leases.now(),
            )
        self.custody.lease_ended(lease)
        if how is LeaseEnd.expired:  # reaped ones are logged once per dead client (sweep)
            log.info(
                "lease %s on %s %s (pid %d)", lease.id, lease.model, how.value, lease.client_pid
            )

    def _promote(self, group: str, holder_uid: int | None) -> None:
        """A warm standby was released (under the lock): its leases serve from now on, and the
        keeper records them so."""
        for lease in self.leases.promote(group, holder_uid):
            self.custody.lease_granted(lease)

    def watched_processes(self) -> set[tuple[int, int]]:
        """(PID, start) of every process whose end the sweep acts on: lease holders and
        waiting engines."""
        return self.leases.watched_along(self.waiting)

    def sweep(self) -> None:
        """End expired leases and those whose client died, and forget waiting engines that are
        gone (the reaper's periodic task)."""
        if self.leases.sweep(self.leases.now(), self.waiting):
            collect_ipc_handles()

    def scrub(self) -> int:
        """Fail every ready model whose arena bytes changed since they were written (the
        periodic scrub); the keeper lets go of its arenas. Returns the number of models failed."""
        failed = scrub(self.models)  # the registry's scrub; this counts it
        for record in failed:
            with self.lock:
                self.custody.model_gone(record)
            self.metrics.arena_corruptions.labels(model=record.id).inc()
        self.metrics.scrubs.inc()
        return len(failed)

    # --- views ---------------------------------------------------------------------------------

    def notify_waiting(self, callback: Callable[[str], None]) -> None:
        """The API wakes its long-polls with the id of every waiting engine that changed."""
        self.waiting.notify(callback)

    def count_refusal(self, code: str) -> None:
        """Count a refused request by its error code (the API's handlers and limits)."""
        self.metrics.refusals.labels(code=code).inc()

    def metrics_exposition(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.metrics.registry)

    @property
    def token(self) -> SecretStr | None:
        """The bearer token every route but /health and /ready needs (None: no token)."""
        return self.settings.token

    def metrics_snapshot(self) -> StateSnapshot:
        """What the state gauges show, read under the lock at scrape time."""
        with self.lock:
            counts: dict[str, int] = {"loading": 0, "ready": 0, "failed": 0}
            resident: dict[str, int] = {}
            for record in self.models.records.values():
                counts[record.state.value] += 1
                resident[record.id] = record.bytes_resident
            return StateSnapshot(
                counts,
                resident,
                self.leases.count(),
                self.parking.count_waiting(),
                self.startup_slots.counts(),
            )

    def health(self) -> Health:
        return Health(
            boot_id=self.boot_id,
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            uptime_s=round(time.monotonic() - self.started, 3),
        )

    def readiness(self) -> Readiness:
        return self.models.readiness()

    def inventory(self) -> Inventory:
        models = self.list_models()
        held: dict[int | None, int] = {}
        with self.lock:
            for record in self.models.records.values():
                for rank in record.ranks:
                    index = rank.arena.device.index
                    held[index] = held.get(index, 0) + rank.arena.nbytes
        in_use = {index for index in held if index is not None}
        return Inventory(
            boot_id=self.boot_id,
            version=__version__,
            devices=device_infos(self.settings.device, self.settings.shm_dir, in_use, held),
            cache_bytes=sum(m.bytes_resident for m in models),
            memory_budget=self.settings.memory_budget_bytes,
            models=models,
            active_leases=sum(m.active_leases for m in models),
            keeper=self.custody.keeper_info(),
        )

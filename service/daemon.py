"""The daemon: one object the API talks to, wiring the registry's parts behind one lock.

It builds the parts with constructor arguments and sets nothing on them afterwards: the keeper's
custody, the model table (``registry/model_table.py``: loads, startup models, readiness, lost
arenas), and the lease desk (``registry/lease_desk.py``), which grants, renews and releases
leases, parked engines and start-up slots, proves their holders, owns the registry's clock and
says what follows when a lease ends. Every decision that could race (granting a lease on a
model that is being unloaded, unloading a model a lease was just granted on) happens under
``self.lock``, so an arena is never released while a lease on it is active. What is left here
is the lifecycle, the periodic tasks, the scrub's counting and the views (health, inventory,
metrics).
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
from protocol.errors import WeightCacheError
from protocol.logsafe import get_logger
from protocol.schemas.health import Health, Readiness
from protocol.schemas.inventory import Inventory
from protocol.schemas.leases import LeaseRequest
from protocol.schemas.manifest import DaemonIdentity
from protocol.schemas.models import ModelInfo
from protocol.version import PROTOCOL_VERSION, __version__
from service.keeper.custody import Custody
from service.memory.devices import device_infos, use_plain_cuda_allocations
from service.memory.shm import ArenaDir, remove_stale_files
from service.metrics import Metrics, StateSnapshot
from service.registry.donation_arenas import DonationArenas
from service.registry.donations import Donations
from service.registry.grant import Grant
from service.registry.lease_desk import LeaseDesk
from service.registry.lease_holders import Caller
from service.registry.model_table import ModelTable
from service.registry.models import ModelRecord
from service.registry.path_policy import allowed_checkpoint_path, api_load_policy
from service.registry.scrub import scrub
from service.settings import DaemonSettings

log = get_logger(__name__)

# Blocking work the app runs in a worker thread every so many seconds: (interval, work, what).
PeriodicTask = tuple[float, Callable[[], object], str]


class Daemon:
    def __init__(
        self,
        settings: DaemonSettings,
        on_startup_failure: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.boot_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.lock = threading.RLock()
        self.metrics = Metrics(
            self.metrics_snapshot,
            {"version": __version__, "protocol_version": str(PROTOCOL_VERSION)},
        )
        # The handle socket, the keeper and adoption: what lets arenas outlive this process.
        self.custody = Custody(settings, self.boot_id, self.lock, self.count_refusal)
        self.models = ModelTable(
            settings,
            self.lock,
            on_loaded=self.metrics.load_seconds.observe,
            on_ready=self.custody.model_ready,
            on_gone=self.custody.model_gone,
            on_startup_failure=on_startup_failure,
            # The desk is built below; an eviction asks its lease table then.
            leases_on=lambda model_id: self.desk.leases.count(model_id),  # noqa: PLW0108
            on_evicted=lambda record, pressure: self.metrics.evictions.labels(
                pressure=pressure.value
            ).inc(),
        )
        # Leases, parked engines and start-up slots: granted, renewed and released at one desk.
        self.desk = LeaseDesk(
            self.boot_id, self.lock, settings, self.metrics, self.models, self.custody
        )
        self.leases = self.desk.leases
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
            DonationArenas(
                settings.device,
                settings.cuda_handles,
                self.boot_id,
                lambda: self.arena_dir,
                self.custody.access_for,
            ),
            self.metrics,
        )

    @property
    def startup_failure(self) -> tuple[str, WeightCacheError] | None:
        """The first startup model that failed to load (unless ``keep_going``), with why."""
        return self.models.startup_failure

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
        # Adopts, before the sweep; passes pending donations' arenas to their donors.
        self.custody.start(self.arena_dir, self.models, self.leases, self.donations.pending_arena)
        self.metrics.leases_granted.labels(via="keeper").inc(self.custody.leases_taken_over)
        if self.arena_dir is not None:
            stale = remove_stale_files(root) + self.arena_dir.remove_stale()  # earlier layout too
            for path in stale:
                log.info("removed stale shared-memory arena %s", path)
        self.desk.start()
        self.models.load_at_start(
            self.settings.startup_models(),
            self.settings.tp_size,
            self.arena_dir,
            self.identity,
            adopted=self.custody.adopted_as,
        )

    def shutdown(self) -> None:
        """Stop; with a keeper, leave the arenas to it (the next daemon takes them over)."""
        self.desk.stop()
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
        return self.desk.model_info(record)

    def list_models(self) -> list[ModelInfo]:
        with self.lock:
            return [self.desk.model_info(r) for r in list(self.models.records.values())]

    def unload(self, model_id: str) -> None:
        """Forget a model and free its arenas; refused while any lease on it is active."""
        self.desk.unload(model_id)

    # --- leases --------------------------------------------------------------------------------

    def grant(self, req: LeaseRequest, caller: Caller | None = None) -> Grant:
        """A lease for ``caller`` (default: this process): :meth:`LeaseDesk.grant`."""
        return self.desk.grant(req, caller or Caller.local())

    def observe_grant_seconds(self, seconds: float) -> None:
        """How long a grant took the API, its rendering included (a histogram)."""
        self.metrics.lease_seconds.observe(seconds)

    def sweep(self) -> None:
        """The reaper's periodic task: :meth:`LeaseDesk.sweep`."""
        self.desk.sweep()

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
        self.desk.changes.subscribe(callback)

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
            counts, resident = self.models.totals()
            donated, donated_bytes = self.models.donated_totals()
            parked, tickets = self.desk.waiting_counts()
            return StateSnapshot(
                counts, resident, self.leases.count(), parked, tickets, donated, donated_bytes
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
        held = self.models.held_by_device()
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

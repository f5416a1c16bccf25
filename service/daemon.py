"""The daemon's composition root: models, leases and their rules, behind one lock.

HTTP routes call these methods and nothing else. Every decision that could race (granting a
lease on a model that is being unloaded, unloading a model a lease was just granted on) happens
under ``self.lock``, so an arena is never released while a lease on it is active.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from modelopt_fp8.checkpoint.opened import CheckpointDir, PathPolicy
from modelopt_fp8.checkpoint.safetensors_files import INDEX_FILE
from modelopt_fp8.processing.pool import lower_priority
from protocol.checksum import storage_checksum
from protocol.errors import (
    ArenaCorruptedError,
    ArenaLostError,
    InsufficientMemoryError,
    InvalidRequestError,
    LayoutMismatchError,
    ModelExistsError,
    ModelFailedError,
    ModelInUseError,
    ModelLoadingError,
    ModelNotFoundError,
    PathNotAllowedError,
    TooManyClientLeasesError,
    TooManyLeasesError,
    WeightCacheError,
)
from protocol.schemas.health import Health, Readiness
from protocol.schemas.inventory import Inventory
from protocol.schemas.layout import Kernel, WeightFormat
from protocol.schemas.leases import LeaseInfo, LeaseRequest
from protocol.schemas.manifest import ArenaDescriptor, CheckpointIdentity, DaemonIdentity
from protocol.schemas.models import ModelInfo, ModelState, default_model_id
from protocol.version import PROTOCOL_VERSION, __version__
from service.logsafe import get_logger
from service.memory.devices import device_infos, process_alive, resolve_placements
from service.memory.shm import ArenaDir, remove_stale_files
from service.metrics import Metrics, StateSnapshot
from service.registry.grant import Grant
from service.registry.leases import Lease, LeaseEnd, LeaseTable
from service.registry.loader import LoadCancelled, LoadRequest, load_model
from service.registry.models import ModelRecord
from service.settings import DaemonSettings

log = get_logger(__name__)

# What every model here was processed for; a lease asking for anything else is refused.
SERVED_KERNEL = Kernel.cutlass
SERVED_FORMAT = WeightFormat.default
CHECKPOINT_FILES = ("config.json", "hf_quant_config.json", INDEX_FILE)


class Daemon:
    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.boot_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.lock = threading.RLock()
        self.models: dict[str, ModelRecord] = {}
        self.leases = LeaseTable(self.boot_id, on_end=self._lease_ended)
        # Models asked for at start and not unloaded since: what /ready waits for.
        self.startup_models: list[str] = []
        # The first startup model that failed (unless keep_going), and who to tell: the CLI
        # stops the server and exits non-zero.
        self.startup_failure: tuple[str, WeightCacheError] | None = None
        self.on_startup_failure: Callable[[], None] | None = None
        self.metrics = Metrics(self.metrics_snapshot)
        self.identity = DaemonIdentity(
            boot_id=self.boot_id,
            protocol_version=PROTOCOL_VERSION,
            weight_cache_version=__version__,
            torch_version=torch.__version__,
        )
        self._threads: list[threading.Thread] = []
        self._draining: set[ModelRecord] = set()  # unloaded while loading, thread still running
        self.arena_dir: ArenaDir | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Make the private arena directory, clean up after dead daemons, and start loading
        the models asked for at start."""
        root = self.settings.shm_dir
        if root.is_dir():
            self.arena_dir = ArenaDir.prepare(root, self.settings.shm_group)
            stale = remove_stale_files(root) + self.arena_dir.remove_stale()  # earlier layout too
            for path in stale:
                log.info("removed stale shared-memory arena %s", path)
        else:
            log.warning("no shared-memory directory %s: CPU arenas cannot be made", root)
        if torch.cuda.is_available():
            # Opening an expandable-segment handle costs time in proportion to its size.
            set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            (set_settings or torch.cuda.memory._set_allocator_settings)("expandable_segments:False")
        for path, model_id in self.settings.startup_models():
            self.startup_models.append(model_id)
            try:
                self.load(path, model_id, self.settings.tp_size, check_allowed=False)
            except WeightCacheError as exc:  # reported by /ready, not fatal to the daemon
                record = ModelRecord(id=model_id, path=path, tp_size=self.settings.tp_size)
                with self.lock:
                    self.models[model_id] = record
                self._load_failed(record, exc)

    def shutdown(self) -> None:
        with self.lock:
            for record in self.models.values():
                record.progress.cancelled.set()
                record.release()
            self.models.clear()
        for thread in self._threads:
            thread.join(timeout=30)
        if self.arena_dir is not None:
            self.arena_dir.close()

    # --- models --------------------------------------------------------------------------------

    def _api_policy(self) -> PathPolicy | None:
        """API loads read only below the allowed roots, checked on every opened file."""
        roots = self.settings.allowed_roots
        return PathPolicy.below(roots, self.settings.follow_symlinks) if roots else None

    def _check_allowed(self, path: Path, policy: PathPolicy | None) -> Path:
        """The real path of a checkpoint directory below an allowed root, after opening the
        files a load reads as the load will (so a FIFO, a symlink out of the roots or a loop
        is refused now, with its code); the load checks each file again as it opens it.
        Blocking filesystem work: call it off the event loop."""
        if policy is None:
            raise PathNotAllowedError(
                "loading over the API is disabled: start the daemon with --allowed-root",
                path=str(path),
            )
        opened = CheckpointDir.open(path, policy)
        try:
            names = [*CHECKPOINT_FILES, *opened.names(".safetensors")]
            for name in names:
                file = opened.open_file(name)
                if file is not None:
                    file.close()
        finally:
            opened.close()
        return opened.real

    def load(
        self, path: Path, model_id: str | None, tp_size: int, check_allowed: bool = True
    ) -> ModelRecord:
        """Register a model and load it in a worker thread (returns at once)."""
        policy = self._api_policy() if check_allowed else PathPolicy()
        if check_allowed:
            path = self._check_allowed(path, policy)
        model_id = model_id or default_model_id(path)
        try:
            placements = resolve_placements(self.settings.device, tp_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), tp_size=tp_size) from exc
        with self.lock:
            if model_id in self.models:
                taken = self.models[model_id]
                raise ModelExistsError(
                    f"model id {model_id!r} is taken ({taken.state.value}, from {taken.path}); "
                    f"DELETE /v1/models/{model_id} to unload it first",
                    model=model_id,
                    state=taken.state.value,
                )
            record = ModelRecord(id=model_id, path=path, tp_size=tp_size)
            self.models[model_id] = record
        request = LoadRequest(
            model_id=model_id,
            path=path,
            tp_size=tp_size,
            placements=placements,
            policy=policy or PathPolicy(),
            arena_dir=self.arena_dir,
            daemon=self.identity,
            reserve=lambda nbytes: self._reserve(record, nbytes),
            opened=lambda ckpt: self._opened(record, ckpt),
        )
        thread = threading.Thread(
            target=self._load, args=(record, request), name=f"load-{model_id}", daemon=True
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return record

    def _opened(self, record: ModelRecord, checkpoint: CheckpointIdentity) -> None:
        with self.lock:
            record.checkpoint = checkpoint

    def _reserve(self, record: ModelRecord, nbytes: int) -> None:
        """Claim budget for a load before it allocates, so concurrent loads cannot together
        exceed it; the claim lasts as long as the record (a failed load gives it back)."""
        budget = self.settings.memory_budget_bytes
        with self.lock:
            if budget is not None:
                holders = [*self.models.values(), *self._draining]
                claimed = sum(r.reserved_bytes for r in holders if r is not record)
                if claimed + nbytes > budget:
                    raise InsufficientMemoryError(
                        f"model needs {nbytes} bytes but the memory budget has "
                        f"{budget - claimed} left",
                        needed=nbytes,
                        available=budget - claimed,
                    )
            record.reserved_bytes = nbytes

    def _load(self, record: ModelRecord, request: LoadRequest) -> None:
        lower_priority()  # planning and hashing yield the CPU to requests, as the pool does
        try:
            self._load_into(record, request)
        finally:
            with self.lock:
                self._draining.discard(record)

    def _load_into(self, record: ModelRecord, request: LoadRequest) -> None:
        log.info("loading %s from %s (tp_size %d)", record.id, record.path, record.tp_size)
        try:
            ranks = load_model(request, record.progress)
        except LoadCancelled:
            log.info("loading %s cancelled by an unload", record.id)
            return
        except WeightCacheError as exc:
            self._load_failed(record, exc)
            return
        except Exception as exc:  # an unexpected bug must still leave the model 'failed'
            log.exception("loading %s failed unexpectedly", record.id)
            self._load_failed(record, WeightCacheError(f"{type(exc).__name__}: {exc}"))
            return
        with self.lock:
            if record.progress.cancelled.is_set() or self.models.get(record.id) is not record:
                for rank in ranks:
                    rank.arena.release()
                return
            record.ranks = ranks
            record.load_seconds = time.monotonic() - record.started_at
            record.state = ModelState.ready
        self.metrics.load_seconds.observe(record.load_seconds)
        log.info(
            "%s ready: %d bytes in %.2f s", record.id, record.bytes_resident, record.load_seconds
        )

    def _load_failed(self, record: ModelRecord, exc: WeightCacheError) -> None:
        with self.lock:
            record.error = exc
            record.state = ModelState.failed
            record.reserved_bytes = 0
            record.load_seconds = time.monotonic() - record.started_at
            fatal = (
                record.id in self.startup_models
                and not self.settings.keep_going
                and self.startup_failure is None
            )
            if fatal:
                self.startup_failure = (record.id, exc)
        log.error("loading %s failed: %s", record.id, exc.explain())
        if fatal and self.on_startup_failure is not None:
            self.on_startup_failure()

    def _check_arenas(self, record: ModelRecord) -> None:
        """Fail a ready model whose arena engines could no longer open (its shared-memory file
        removed or replaced under the daemon), so that no grant names it. The model is not
        rebuilt: an operator unloads and loads it again, or restarts the daemon. Its memory is
        given back; engines that mapped it keep their pages. Caller holds the lock."""
        if record.state is not ModelState.ready:
            return
        for rank in record.ranks:
            why = rank.arena.lost()
            if why is None:
                continue
            record.error = ArenaLostError(
                f"the arena of rank {rank.manifest.tp_rank} is gone ({why}); unload the model "
                "and load it again",
                tp_rank=rank.manifest.tp_rank,
            )
            record.state = ModelState.failed
            record.reserved_bytes = 0
            record.release()
            log.error("%s failed: %s", record.id, record.error)
            return

    def model(self, model_id: str) -> ModelRecord:
        with self.lock:
            record = self.models.get(model_id)
        if record is None:
            raise ModelNotFoundError(f"no model {model_id!r}", model=model_id)
        return record

    def model_info(self, record: ModelRecord) -> ModelInfo:
        with self.lock:
            self._check_arenas(record)
            return record.info(self.leases.count(record.id))

    def list_models(self) -> list[ModelInfo]:
        with self.lock:
            for record in self.models.values():
                self._check_arenas(record)
            return [r.info(self.leases.count(r.id)) for r in self.models.values()]

    def unload(self, model_id: str) -> None:
        """Forget a model and free its arenas; refused while any lease on it is active."""
        self.sweep()
        with self.lock:
            record = self.model(model_id)
            active = self.leases.count(model_id)
            if active:
                raise ModelInUseError(
                    f"model {model_id!r} has {active} active lease(s)",
                    model=model_id,
                    active_leases=active,
                )
            del self.models[model_id]
            if model_id in self.startup_models:  # unloaded on purpose: no longer awaited
                self.startup_models.remove(model_id)
            if record.state is ModelState.loading:
                # Its thread is still allocating: its budget claim stands until it stops.
                self._draining.add(record)
                record.progress.cancelled.set()
        record.release()  # outside the lock: unmapping gigabytes takes a while
        log.info("unloaded %s", model_id)

    # --- leases --------------------------------------------------------------------------------

    def grant(self, req: LeaseRequest) -> Grant:
        with self.lock:
            record = self.model(req.model)
            self._check_arenas(record)
            if record.state is ModelState.loading:
                raise ModelLoadingError(
                    f"model {req.model!r} is still loading",
                    model=req.model,
                    retry_after_s=record.retry_after_s(),
                )
            if record.state is ModelState.failed:
                assert record.error is not None
                raise ModelFailedError(
                    f"model {req.model!r} failed to load: {record.error.detail}",
                    model=req.model,
                    reason=record.error.code,
                )
            mismatches = {}
            for name, asked, served in (
                ("kernel", req.kernel, SERVED_KERNEL.value),
                ("format", req.format, SERVED_FORMAT.value),
                ("tp_size", req.tp_size, record.tp_size),
            ):
                if asked != served:
                    mismatches[name] = {"requested": asked, "served": served}
            if mismatches:
                raise LayoutMismatchError(
                    f"requested {', '.join(mismatches)} differ from what {req.model!r} was "
                    "processed for",
                    model=req.model,
                    mismatches=mismatches,
                )
            if req.tp_rank >= record.tp_size:
                raise InvalidRequestError(
                    f"tp_rank {req.tp_rank} is outside tp_size {record.tp_size}"
                )
            ttl = self._ttl(req.ttl_s or self.settings.default_ttl_s)
            self._check_lease_caps(req.client_pid)
            rank = record.ranks[req.tp_rank]
            handle = rank.arena.export()  # fresh for every lease
            lease = self.leases.add(
                req.model, req.tp_rank, req.tp_size, req.client_pid, ttl, self.leases.now()
            )
            info = lease.info(self.boot_id)
        self.metrics.leases_granted.inc()
        arena = ArenaDescriptor(index=0, nbytes=rank.arena.nbytes, handle=handle)
        return Grant(info, rank, [arena], req.known_layout != rank.manifest.layout_digest)

    def _check_lease_caps(self, client_pid: int) -> None:
        self.leases.expire(self.leases.now())
        cap = self.settings.max_leases
        if self.leases.count() >= cap:
            raise TooManyLeasesError(
                f"the daemon holds its maximum of {cap} active leases", limit=cap
            )
        cap = self.settings.max_leases_per_client
        if self.leases.count_client(client_pid) >= cap:
            raise TooManyClientLeasesError(
                f"client process {client_pid} holds its maximum of {cap} active leases",
                client_pid=client_pid,
                limit=cap,
            )

    def lease(self, lease_id: str) -> LeaseInfo:
        with self.lock:
            return self.leases.get(lease_id, self.leases.now()).info(self.boot_id)

    def list_leases(self) -> list[LeaseInfo]:
        with self.lock:
            self.leases.expire(self.leases.now())
            return [lease.info(self.boot_id) for lease in self.leases.active.values()]

    def _ttl(self, ttl_s: float) -> float:
        if ttl_s > self.settings.max_ttl_s:
            raise InvalidRequestError(
                f"ttl_s {ttl_s} exceeds this daemon's maximum of {self.settings.max_ttl_s}"
            )
        return ttl_s

    def renew(self, lease_id: str, ttl_s: float | None) -> LeaseInfo:
        if ttl_s is not None:
            self._ttl(ttl_s)
        with self.lock:
            return self.leases.renew(lease_id, ttl_s, self.leases.now()).info(self.boot_id)

    def release(self, lease_id: str) -> None:
        with self.lock:
            self.leases.get(lease_id, self.leases.now())
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
        if how is LeaseEnd.expired:  # reaped ones are logged once per dead client (sweep)
            log.info(
                "lease %s on %s %s (pid %d)", lease.id, lease.model, how.value, lease.client_pid
            )

    def sweep(self) -> None:
        """End expired leases and those whose client died. Blocking (it reads /proc): the
        reaper runs it in a thread. The lock is held for the heap pops and the PID list only,
        never across the /proc reads, so grants on the event loop do not wait on it."""
        with self.lock:
            ended = self.leases.expire(self.leases.now())
            watched = self.leases.watched()
        dead = [(pid, start) for pid, start in watched if not process_alive(pid, start)]
        if dead:
            with self.lock:
                for pid, start in dead:
                    reaped = self.leases.reap(pid, start)
                    ended += reaped
                    if reaped:
                        log.info("client pid %d is gone: reaped its %d lease(s)", pid, len(reaped))
        if ended and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def scrub(self) -> int:
        """Re-check every ready model's arenas against the per-tensor checksums taken when they
        were written, and fail a model whose bytes changed (no new leases; its error says
        ``arena_corrupted``). Blocking (hashes every resident byte): run it in a thread.
        Returns the number of models failed."""
        with self.lock:
            targets = [
                (record, [(rank.manifest, rank.arena.base) for rank in record.ranks])
                for record in self.models.values()
                if record.state is ModelState.ready
            ]
        failed = 0
        for record, ranks in targets:
            changed = next(
                (
                    (manifest.tp_rank, entry.name)
                    for manifest, base in ranks
                    for entry in manifest.tensors
                    if storage_checksum(base[entry.offset : entry.offset + entry.nbytes])
                    != entry.checksum
                ),
                None,
            )
            if changed is None:
                continue
            rank, tensor = changed
            error = ArenaCorruptedError(
                f"tensor {tensor} of rank {rank} no longer matches its checksum: the arena "
                "was written after loading; unload and load the model again",
                tensor=tensor,
                tp_rank=rank,
            )
            with self.lock:
                if self.models.get(record.id) is not record or record.state is not ModelState.ready:
                    continue
                record.state = ModelState.failed
                record.error = error
            failed += 1
            self.metrics.arena_corruptions.labels(model=record.id).inc()
            log.error("model %s failed its scrub: %s", record.id, error)
        self.metrics.scrubs.inc()
        return failed

    # --- views ---------------------------------------------------------------------------------

    def metrics_snapshot(self) -> StateSnapshot:
        """What the state gauges show, read under the lock at scrape time."""
        with self.lock:
            counts: dict[str, int] = {"loading": 0, "ready": 0, "failed": 0}
            resident: dict[str, int] = {}
            for record in self.models.values():
                counts[record.state.value] += 1
                resident[record.id] = record.bytes_resident
            return StateSnapshot(counts, resident, self.leases.count())

    def health(self) -> Health:
        return Health(
            boot_id=self.boot_id,
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            uptime_s=time.monotonic() - self.started,
        )

    def readiness(self) -> Readiness:
        """Ready once every startup model still asked for is ready; with ``keep_going``, once
        each is ready or failed (the failed ones are listed, and engines fall back). A model
        whose arena was lost counts too, whether or not it was asked for at start."""
        with self.lock:
            for held in self.models.values():
                self._check_arenas(held)
            lost = [m for m, r in self.models.items() if isinstance(r.error, ArenaLostError)]
            wanted = [*self.startup_models, *(m for m in lost if m not in self.startup_models)]
            records = [self.models[m] for m in wanted if m in self.models]
            states = {r.id: r.state for r in records}
            failed = {
                r.id: str(r.error) if r.error else "failed"
                for r in records
                if r.state is ModelState.failed
            }
        waiting = [m for m, s in states.items() if s is ModelState.loading]
        blocking = bool(failed) and not self.settings.keep_going
        return Readiness(
            ready=not waiting and not blocking, models=states, waiting=waiting, failed=failed
        )

    def inventory(self) -> Inventory:
        models = self.list_models()
        with self.lock:
            in_use = {
                rank.arena.device.index
                for record in self.models.values()
                for rank in record.ranks
                if rank.arena.device.index is not None
            }
        return Inventory(
            boot_id=self.boot_id,
            version=__version__,
            devices=device_infos(self.settings.device, self.settings.shm_dir, in_use),
            cache_bytes=sum(m.bytes_resident for m in models),
            memory_budget=self.settings.memory_budget_bytes,
            models=models,
            active_leases=sum(m.active_leases for m in models),
        )

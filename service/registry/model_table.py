"""The models the daemon holds: their records, the threads loading them, the memory budget their
loads claim, and the startup models ``/ready`` waits for.

It shares the daemon's lock: a grant, an unload and a finishing load decide under one lock, so
an arena is never released while a lease on it is active, and a load that an unload overtook
gives its arenas back instead of publishing them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from modelopt_fp8.checkpoint.opened import PathPolicy
from modelopt_fp8.processing.pool import lower_priority
from protocol.devices import Placement
from protocol.errors import (
    ArenaLostError,
    DonationExistsError,
    DonationNotFoundError,
    InsufficientMemoryError,
    InvalidRequestError,
    ModelExistsError,
    ModelNotFoundError,
    TooManyLoadsError,
    TooManyModelsError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from protocol.schemas.health import Readiness
from protocol.schemas.manifest import CheckpointIdentity, DaemonIdentity
from protocol.schemas.models import ModelState, default_model_id
from service.memory.devices import resolve_placements
from service.memory.shm import ArenaDir
from service.memory.trim import give_back_freed_memory
from service.registry.eviction import Pressure, eviction_order
from service.registry.header_budget import HeaderBudget
from service.registry.loader import LoadCancelled, LoadRequest, ResidentRank, load_model
from service.registry.models import ModelRecord
from service.registry.readiness import readiness as decide_readiness
from service.settings import DaemonSettings

# The daemon's own lines (loads, failures) keep the logger name operators filter them by.
log = get_logger("service.daemon")


class ModelTable:
    def __init__(
        self,
        settings: DaemonSettings,
        lock: threading.RLock,
        on_loaded: Callable[[float], None] = lambda seconds: None,
        on_ready: Callable[[ModelRecord], None] = lambda record: None,
        on_gone: Callable[[ModelRecord], None] = lambda record: None,
        on_startup_failure: Callable[[], None] | None = None,
        leases_on: Callable[[str], int] = lambda model_id: 0,
        on_evicted: Callable[[ModelRecord, Pressure], None] = lambda record, pressure: None,
    ) -> None:
        self.settings = settings
        self.lock = lock
        self.on_loaded = on_loaded  # told each successful load's seconds (a histogram)
        self.on_ready = on_ready  # told, under the lock, each model that became ready (kept)
        # told each ready model that failed after, or was evicted (the keeper drops it)
        self.on_gone = on_gone
        self.leases_on = leases_on  # a model's active leases (an eviction never takes a leased one)
        self.on_evicted = on_evicted  # told each model evicted, and for what (a counter)
        self.records: dict[str, ModelRecord] = {}
        # Models asked for at start and not unloaded since: what /ready waits for.
        self.startup: list[str] = []
        # The first startup model that failed (unless keep_going), and who to tell: the CLI
        # stops the server and exits non-zero.
        self.startup_failure: tuple[str, WeightCacheError] | None = None
        self.on_startup_failure = on_startup_failure
        self._threads: list[threading.Thread] = []
        self._draining: set[ModelRecord] = set()  # unloaded while loading, thread still running
        self.header_budget = HeaderBudget()  # what the loads running at once may parse
        self._header_claims: dict[ModelRecord, int] = {}

    # --- records -------------------------------------------------------------------------------

    def get(self, model_id: str) -> ModelRecord:
        with self.lock:
            record = self.records.get(model_id)
        if record is None:
            raise ModelNotFoundError(f"no model {model_id!r}", model=model_id)
        return record

    def remove(self, model_id: str) -> ModelRecord:
        """Forget a model (caller holds the lock and checked its leases) and stop its load if one
        runs; the caller releases its arenas, outside the lock."""
        record = self.get(model_id)
        del self.records[model_id]
        if model_id in self.startup:  # unloaded on purpose: no longer awaited
            self.startup.remove(model_id)
        if record.state is ModelState.loading:
            # Its thread is still allocating: its budget claim stands until it stops.
            self._draining.add(record)
            record.progress.cancelled.set()
        return record

    def release_all(self) -> None:
        """Cancel every load, free every arena, and wait for the load threads (shutdown)."""
        with self.lock:
            for record in self.records.values():
                record.progress.cancelled.set()
                record.release()
            self.records.clear()
        self.join_loads(timeout=30)

    def detach_all(self) -> None:
        """Cancel every load and drop this process's hold on every arena without giving the
        memory back: the keeper holds it for the next daemon (shutdown with a keeper)."""
        with self.lock:
            for record in self.records.values():
                record.progress.cancelled.set()
                for rank in record.ranks:
                    rank.arena.detach()
                record.ranks = []
            self.records.clear()
        self.join_loads(timeout=30)

    def totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """Models by state, and each model's resident bytes (the state gauges)."""
        with self.lock:
            counts = {state.value: 0 for state in ModelState}
            resident: dict[str, int] = {}
            for record in self.records.values():
                counts[record.state.value] += 1
                resident[record.id] = record.bytes_resident
            return counts, resident

    def donated_totals(self) -> tuple[dict[str, int], int]:
        """Donated models by state (loading: offered, not committed), and the arena bytes the
        ready ones hold (the donation gauges)."""
        with self.lock:
            counts = {state.value: 0 for state in ModelState}
            resident = 0
            for record in self.records.values():
                if record.donation:
                    counts[record.state.value] += 1
                    if record.state is ModelState.ready:
                        resident += record.bytes_resident
            return counts, resident

    def held_by_device(self) -> dict[int | None, int]:
        """Arena bytes held on each device index (None: host memory), for the inventory."""
        held: dict[int | None, int] = {}
        with self.lock:
            for record in self.records.values():
                for rank in record.ranks:
                    index = rank.arena.device.index
                    held[index] = held.get(index, 0) + rank.arena.nbytes
        return held

    def join_loads(self, timeout: float) -> None:
        """Wait for the load threads started so far, each up to ``timeout`` seconds."""
        for thread in list(self._threads):
            thread.join(timeout=timeout)

    def fail_lost_arenas(self, record: ModelRecord) -> None:
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
            record.fail(
                ArenaLostError(
                    f"the arena of rank {rank.manifest.tp_rank} is gone ({why}); unload the "
                    "model and load it again",
                    tp_rank=rank.manifest.tp_rank,
                )
            )
            self.on_gone(record)
            log.error("%s failed: %s", record.id, record.error)
            return

    def readiness(self) -> Readiness:
        """What /ready answers (:func:`service.registry.readiness.readiness`); lost arenas are
        noticed first, so a model whose file was removed counts as failed."""
        with self.lock:
            for record in self.records.values():
                self.fail_lost_arenas(record)
            return decide_readiness(self.records.values(), self.settings.keep_going)

    # --- loads ---------------------------------------------------------------------------------

    def load_at_start(
        self,
        models: list[tuple[Path, str]],
        tp_size: int,
        arena_dir: ArenaDir | None,
        daemon: DaemonIdentity,
        adopted: Callable[[str, Path, int], bool] = lambda model_id, path, tp_size: False,
    ) -> None:
        """Start loading the models asked for at start, from anywhere (no allowed root applies):
        ``/ready`` waits for them, and one whose load cannot even start is listed as failed.
        One ``adopted`` says was taken over from the keeper is ready already: not loaded."""
        for path, model_id in models:
            self.startup.append(model_id)
            if adopted(model_id, path, tp_size):
                continue
            try:
                self.start_load(path, model_id, tp_size, PathPolicy(), arena_dir, daemon)
            except WeightCacheError as exc:  # reported by /ready, not fatal to the daemon
                record = ModelRecord(id=model_id, path=path, tp_size=tp_size)
                with self.lock:
                    self.records[model_id] = record
                self._load_failed(record, exc)

    def start_load(
        self,
        path: Path,
        model_id: str | None,
        tp_size: int,
        policy: PathPolicy,
        arena_dir: ArenaDir | None,
        daemon: DaemonIdentity,
        limited: bool = False,
    ) -> ModelRecord:
        """Register a model and load it in a worker thread (returns at once). A ``limited``
        load (one asked over the API) is refused past the caps on models and on loads at once:
        each load is a thread and open files, each model a record, and a client must not be
        able to multiply them."""
        model_id = model_id or default_model_id(path)
        try:
            placements = resolve_placements(self.settings.device, tp_size)
        except ValueError as exc:
            raise InvalidRequestError.of_field(
                "tp_size", str(exc), "value_error", tp_size=tp_size
            ) from exc
        with self.lock:
            if model_id in self.records:
                taken = self.records[model_id]
                raise ModelExistsError(
                    f"model id {model_id!r} is taken ({taken.state.value}, from {taken.path}); "
                    f"DELETE /v1/models/{model_id} to unload it first",
                    model=model_id,
                    state=taken.state,
                )
            if limited:
                self._check_room(evict=True)
            record = ModelRecord(id=model_id, path=path, tp_size=tp_size)
            self.records[model_id] = record
        request = LoadRequest(
            model_id=model_id,
            path=path,
            tp_size=tp_size,
            placements=placements,
            policy=policy,
            arena_dir=arena_dir,
            daemon=daemon,
            reserve=lambda nbytes: self._reserve(record, nbytes),
            opened=lambda ckpt: self._opened(record, ckpt),
            cuda_handles=self.settings.cuda_handles,
            claim_headers=lambda nbytes: self._claim_headers(record, nbytes),
            make_free=self.make_free,
        )
        thread = threading.Thread(
            target=self._run_load, args=(record, request), name=f"load-{model_id}", daemon=True
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return record

    # --- donated models (service/registry/donations.py) ----------------------------------------

    def add_donated(self, record: ModelRecord, nbytes: int) -> None:
        """Register a model an engine is donating (no load thread: the donor writes it), past
        the same caps and budget as a load; its id taken is a :class:`DonationExistsError`."""
        with self.lock:
            if record.id in self.records:
                raise DonationExistsError(
                    f"{record.id} is held already ({self.records[record.id].state.value})",
                    model=record.id,
                )
            self._check_room(evict=True)
            self._reserve(record, nbytes)
            self.records[record.id] = record

    def publish_donated(self, record: ModelRecord, ranks: list[ResidentRank]) -> None:
        """A committed donation is ready, as a finished load is (the keeper told); one
        unloaded meanwhile is refused (its caller releases the arena)."""
        with self.lock:
            if self.records.get(record.id) is not record:
                raise DonationNotFoundError(
                    f"{record.id} was unloaded while donated", model=record.id
                )
            record.ranks = ranks
            record.checkpoint = ranks[0].manifest.checkpoint
            record.progress.bytes_done = record.progress.bytes_total
            record.progress.tensors_done = record.progress.tensors_total
            record.load_seconds = time.monotonic() - record.started_at
            record.state = ModelState.ready
        self.on_ready(record)

    def remove_donated(self, record: ModelRecord) -> None:
        """Forget a donation that did not complete (caller holds the lock; it releases the
        arena)."""
        if self.records.get(record.id) is record:
            del self.records[record.id]
        self._draining.discard(record)  # an unload during the donation marked it draining
        record.reserved_bytes = 0

    def check_room(self) -> None:
        """Refuse one more model past ``max_models``, one more load past
        ``max_concurrent_loads`` (loads an unload overtook still count until they stop); a model
        that could be evicted counts as room (nothing is evicted here)."""
        with self.lock:
            self._check_room(evict=False)

    def _check_room(self, evict: bool) -> None:
        loading = [r for r in self.records.values() if r.state is ModelState.loading]
        cap = self.settings.max_concurrent_loads
        if len(loading) + len(self._draining) >= cap:
            raise TooManyLoadsError(
                f"the daemon runs its maximum of {cap} loads at once",
                limit=cap,
                retry_after_s=min((r.retry_after_s() for r in loading), default=1),
            )
        cap = self.settings.max_models
        if len(self.records) < cap:
            return
        if evict:
            self.evict_until(lambda freed: len(self.records) < cap, Pressure.max_models)
            held = len(self.records)
        else:
            held = len(self.records) - len(eviction_order(self.records.values(), self.leases_on))
        if held >= cap:
            raise TooManyModelsError(
                f"the daemon holds its maximum of {cap} models (failed ones count until unloaded)",
                limit=cap,
            )

    # --- making room (service/registry/eviction.py) --------------------------------------------

    def evict_until(
        self,
        fits: Callable[[int], bool],
        pressure: Pressure,
        placement: Placement | None = None,
    ) -> int:
        """Evict models, in eviction order (with an arena on ``placement`` if given), until
        ``fits`` the bytes freed so far; returns those bytes. Caller holds the lock."""
        freed = 0
        for record in eviction_order(self.records.values(), self.leases_on, placement):
            if fits(freed):
                break
            freed += self._evict(record, pressure)
        return freed

    def make_free(self, placement: Placement, needed: int, free: Callable[[], int]) -> int:
        """Evict until ``placement`` has ``needed`` bytes free, ``free`` measuring it before;
        the bytes free then, counting what the evicted models give back (the keeper may let go
        of their memory a moment later)."""
        with self.lock:
            before = free()
            return before + self.evict_until(
                lambda freed: before + freed >= needed, Pressure.free_memory, placement
            )

    def _evict(self, record: ModelRecord, pressure: Pressure) -> int:
        """Forget ``record`` and release its arenas, as an unload does; its bytes."""
        nbytes = record.bytes_resident
        del self.records[record.id]
        self.on_gone(record)  # the keeper lets go of it
        record.release()
        record.reserved_bytes = 0
        self.on_evicted(record, pressure)
        log.info("evicted %s (%d bytes, no lease) for %s", record.id, nbytes, pressure.value)
        return nbytes

    def _opened(self, record: ModelRecord, checkpoint: CheckpointIdentity) -> None:
        with self.lock:
            record.checkpoint = checkpoint

    def _reserve(self, record: ModelRecord, nbytes: int) -> None:
        """Claim budget for a load before it allocates, so concurrent loads cannot together
        exceed it (models that may be evicted make room first); the claim lasts as long as the
        record (a failed load gives it back)."""
        budget = self.settings.memory_budget_bytes
        with self.lock:
            if budget is not None:

                def claimed() -> int:
                    holders = [*self.records.values(), *self._draining]
                    return sum(r.reserved_bytes for r in holders if r is not record)

                self.evict_until(lambda freed: claimed() + nbytes <= budget, Pressure.memory_budget)
                left = budget - claimed()
                if nbytes > left:
                    raise InsufficientMemoryError(
                        f"model needs {nbytes} bytes but the memory budget has {left} left",
                        needed=nbytes,
                        available=left,
                    )
            record.reserved_bytes = nbytes

    def _claim_headers(self, record: ModelRecord, nbytes: int) -> None:
        """Wait for room in the header budget (an unload stops the wait); the claim lasts as
        long as the load."""
        if not self.header_budget.claim(nbytes, record.progress.cancelled):
            raise LoadCancelled(f"model {record.id} was unloaded while waiting to load")
        self._header_claims[record] = nbytes

    def _run_load(self, record: ModelRecord, request: LoadRequest) -> None:
        lower_priority()  # planning and hashing yield the CPU to requests, as the pool does
        try:
            self._load_into(record, request)
        finally:
            self.header_budget.release(self._header_claims.pop(record, 0))
            with self.lock:
                self._draining.discard(record)
            if record.state is not ModelState.ready:
                # A failed or cancelled load (a hostile checkpoint's, say) leaves nothing the
                # next load reuses: its buffers go back to the kernel.
                give_back_freed_memory()

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
            if record.progress.cancelled.is_set() or self.records.get(record.id) is not record:
                for rank in ranks:
                    rank.arena.release()
                return
            record.ranks = ranks
            record.load_seconds = time.monotonic() - record.started_at
            record.state = ModelState.ready
            self.on_ready(record)  # under the lock: an unload racing it is told after it
        self.on_loaded(record.load_seconds)
        log.info(
            "%s ready: %d bytes in %.2f s", record.id, record.bytes_resident, record.load_seconds
        )

    def _load_failed(self, record: ModelRecord, exc: WeightCacheError) -> None:
        with self.lock:
            record.fail(exc)
            fatal = (
                record.id in self.startup
                and not self.settings.keep_going
                and self.startup_failure is None
            )
            if fatal:
                self.startup_failure = (record.id, exc)
        log.error("loading %s failed: %s", record.id, exc.explain())
        if fatal and self.on_startup_failure is not None:
            self.on_startup_failure()

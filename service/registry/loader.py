"""Loading one model into arenas: plan every rank, check the budget, allocate, process, checksum,
and describe the result. Any failure releases everything it allocated, so a model that fails to
load holds no memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.checkpoint.opened import PathPolicy
from modelopt_fp8.processing.execute import StorageFor, execute_plan
from modelopt_fp8.processing.plan import ModelPlan, plan_model
from modelopt_fp8.processing.pool import shared_pool
from modelopt_fp8.processing.rows import FileRange
from protocol.devices import Placement
from protocol.dtypes import to_wire
from protocol.errors import InsufficientMemoryError
from protocol.logsafe import get_logger
from protocol.schemas.manifest import (
    CheckpointIdentity,
    DaemonIdentity,
    DeviceKind,
    Manifest,
    TensorEntry,
)
from protocol.version import PROTOCOL_VERSION, __version__
from service.memory.arena import Arena, ShmArena, allocate_arena
from service.memory.digest import kept_digest
from service.memory.layout import pack
from service.memory.shm import ArenaDir

log = get_logger(__name__)


class LoadCancelled(Exception):
    """An unload stopped this load while it ran."""


@dataclass
class Progress:
    """Counters a load updates and the API reads (plain ints: reads need no lock)."""

    bytes_total: int = 0
    tensors_total: int = 0
    bytes_done: int = 0
    tensors_done: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class ResidentRank:
    """One TP rank of a loaded model: its arena and its manifest (without handles).

    The manifest's JSON is rendered once here: a lease only adds its own handle beside it.
    """

    arena: Arena
    manifest: Manifest
    # service.memory.digest of a GPU arena taken at load, checked when a new daemon adopts it.
    digest: str | None = None
    manifest_json: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.manifest_json = self.manifest.model_dump_json().encode()


def _measured(placement: Placement, needed: int, free: Callable[[], int]) -> int:
    """The bytes free on ``placement``, nothing evicted (a load outside a daemon's table)."""
    return free()


@dataclass(frozen=True)
class LoadRequest:
    model_id: str
    path: Path
    tp_size: int
    placements: list[Placement]
    policy: PathPolicy  # where the checkpoint's files may be read from
    arena_dir: ArenaDir | None  # where CPU arenas go (None: no shared memory)
    daemon: DaemonIdentity
    # Claims bytes of the daemon's memory budget for this load; raises if they do not fit.
    reserve: Callable[[int], None]
    # Told what the checkpoint is as soon as it opened (engines match models by fingerprint),
    # and again with the full-tier digest once every byte was read.
    opened: Callable[[CheckpointIdentity], None]
    cuda_handles: str = "fd"  # GPU arenas: shareable allocations (fd) or legacy IPC (ipc)
    # Told the bytes of safetensors headers the load will parse, before it reads them: may wait
    # for room beside the other loads (:mod:`service.registry.header_budget`), or cancel.
    claim_headers: Callable[[int], None] = lambda nbytes: None
    # Asked, before the free memory on a placement is checked, to make ``needed`` bytes free
    # there (``free`` measures it): answers the bytes free, counting what it evicted.
    make_free: Callable[[Placement, int, Callable[[], int]], int] = _measured

    @classmethod
    def unmanaged(
        cls,
        model_id: str,
        path: Path,
        placements: list[Placement],
        arena_dir: ArenaDir | None = None,
    ) -> LoadRequest:
        """A load outside a daemon (benchmarks, tests): one TP rank per placement, any path,
        no budget, nobody told what opened, an identity of its own."""
        return cls(
            model_id=model_id,
            path=path,
            tp_size=len(placements),
            placements=placements,
            policy=PathPolicy(),
            arena_dir=arena_dir,
            daemon=DaemonIdentity(
                boot_id="unmanaged",
                protocol_version=PROTOCOL_VERSION,
                weight_cache_version=__version__,
                torch_version=torch.__version__,
            ),
            reserve=lambda nbytes: None,
            opened=lambda identity: None,
        )


@contextlib.contextmanager
def _destinations(arena: Arena) -> Iterator[StorageFor]:
    """Where the processing writes each tensor: the arena's memory on a GPU; on the host its
    file, through ``pwrite``, so the daemon never maps the pages it fills (faulting in every page
    of a fresh mapping costs more than the copy)."""
    if not isinstance(arena, ShmArena):
        yield arena.storage
        return
    offsets = arena.layout.offsets
    fd = os.open(arena.path, os.O_RDWR)
    try:
        yield lambda spec: FileRange(fd, offsets[spec.name], spec.nbytes)
    finally:
        os.close(fd)


def _free_on(placement: Placement, arena_dir: ArenaDir | None) -> Callable[[], int] | None:
    """What measures the bytes free where ``placement``'s arena goes (None: nothing to check)."""
    if placement.kind is DeviceKind.cuda:
        assert placement.index is not None
        return functools.partial(_gpu_free, placement.index)
    if arena_dir is not None:
        return functools.partial(_shm_free, arena_dir.path)
    return None


def _gpu_free(index: int) -> int:
    return torch.cuda.mem_get_info(index)[0]


def _shm_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _check_budget(req: LoadRequest, needed: int) -> None:
    req.reserve(needed)
    for placement in set(req.placements):
        share = needed * req.placements.count(placement) // len(req.placements)
        make_room(placement, share, req.arena_dir, req.make_free)


def make_room(
    placement: Placement,
    needed: int,
    arena_dir: ArenaDir | None,
    make_free: Callable[[Placement, int, Callable[[], int]], int],
) -> None:
    """Make ``needed`` more bytes of arena fit where ``placement`` puts them (the GPU's free
    memory, or the shared-memory directory's), through ``make_free`` (which may evict unleased
    donated models), else refuse typed."""
    free = _free_on(placement, arena_dir)
    if free is None:
        return
    available = make_free(placement, needed, free)
    if needed > available:
        where = "shared memory" if placement.index is None else f"GPU {placement.index}"
        raise InsufficientMemoryError(
            f"{needed} bytes needed in {where}, {available} free",
            needed=needed,
            available=available,
        )


def _manifest(
    req: LoadRequest,
    checkpoint: CheckpointIdentity,
    plan: ModelPlan,
    arena: Arena,
    checksums: dict[str, str],
) -> Manifest:
    offsets = arena.layout.offsets
    manifest = Manifest(
        model=req.model_id,
        tp_rank=plan.tp_rank,
        tp_size=plan.tp_size,
        daemon=req.daemon,
        device=arena.device,
        checkpoint=checkpoint,
        tensors=[
            TensorEntry(
                name=s.name,
                arena=0,
                offset=offsets[s.name],
                nbytes=s.nbytes,
                dtype=to_wire(s.dtype),
                shape=list(s.shape),
                stride=list(s.stride),
                checksum=checksums[s.name],
            )
            for s in plan.specs
        ],
        layers=plan.layouts,
        carried=plan.carried_layouts,
        layout_digest="",
    )
    layout = manifest.model_dump_json(exclude={"layout_digest"}).encode()
    return manifest.model_copy(update={"layout_digest": xxhash.xxh3_128_hexdigest(layout)})


class _Run:
    """One load under way: its progress, and the unload that may stop it between steps."""

    LOG_EVERY_S = 2.0

    def __init__(self, model_id: str, progress: Progress) -> None:
        self.model_id = model_id
        self.progress = progress
        self.last_log = time.monotonic()

    def check_cancelled(self) -> None:
        if self.progress.cancelled.is_set():
            raise LoadCancelled(f"model {self.model_id} was unloaded while loading")

    def advance(self, nbytes: int, ntensors: int) -> None:
        """The processing wrote ``nbytes`` in ``ntensors`` more: count them, stop if unloaded,
        log now and then."""
        progress = self.progress
        progress.bytes_done += nbytes
        progress.tensors_done += ntensors
        self.check_cancelled()
        if time.monotonic() - self.last_log > self.LOG_EVERY_S:
            self.last_log = time.monotonic()
            log.info(
                "loading %s: %.0f%% (%d/%d bytes, %d/%d tensors)",
                self.model_id,
                100 * progress.bytes_done / max(1, progress.bytes_total),
                progress.bytes_done,
                progress.bytes_total,
                progress.tensors_done,
                progress.tensors_total,
            )


def _identity(ckpt: Checkpoint) -> CheckpointIdentity:
    """What the checkpoint is, as soon as it opened (every tier but ``full``)."""
    return CheckpointIdentity(
        path=str(ckpt.path),
        fingerprint=ckpt.fingerprint,
        digests=ckpt.digests,
        architecture=ckpt.dims.architecture,
        quant_algo=ckpt.quant.quant_algo,
        kv_cache_quant_algo=ckpt.quant.kv_cache_quant_algo,
    )


def _plan_ranks(ckpt: Checkpoint, req: LoadRequest, run: _Run) -> list[ModelPlan]:
    plans = []
    for rank in range(req.tp_size):  # an unload stops the planning too
        run.check_cancelled()
        plans.append(plan_model(ckpt, req.tp_size, rank))
    run.progress.bytes_total = sum(plan.total_bytes for plan in plans)
    run.progress.tensors_total = sum(len(plan.specs) for plan in plans)
    return plans


def _with_full_digest(
    ckpt: Checkpoint, identity: CheckpointIdentity, run: _Run
) -> CheckpointIdentity:
    """The full identity tier, read while the files are still in the page cache from
    processing."""
    full = ckpt.full_digest(run.check_cancelled, shared_pool()[0])
    digests = ckpt.digests.model_copy(update={"full": full})
    return identity.model_copy(update={"digests": digests})


def load_model(req: LoadRequest, progress: Progress) -> list[ResidentRank]:
    """Load every rank of a model; raises a typed error and holds nothing on failure."""
    arenas: list[Arena] = []
    ckpt = Checkpoint.open(req.path, req.policy, req.claim_headers)
    identity = _identity(ckpt)
    req.opened(identity)
    run = _Run(req.model_id, progress)
    try:
        plans = _plan_ranks(ckpt, req, run)
        layouts = [pack(plan.specs) for plan in plans]
        run.check_cancelled()
        _check_budget(req, sum(layout.nbytes for layout in layouts))
        checksums = []
        for plan, layout, placement in zip(plans, layouts, req.placements, strict=True):
            label = f"{req.model_id}-r{plan.tp_rank}"
            arena = allocate_arena(
                layout, placement, req.arena_dir, req.daemon.boot_id, label, req.cuda_handles
            )
            arenas.append(arena)
            with _destinations(arena) as storage_for:
                checksums.append(execute_plan(ckpt, plan, storage_for, run.advance))
        identity = _with_full_digest(ckpt, identity, run)
        req.opened(identity)
        return [
            ResidentRank(arena, _manifest(req, identity, plan, arena, sums), kept_digest(arena))
            for plan, arena, sums in zip(plans, arenas, checksums, strict=True)
        ]
    except BaseException:
        for arena in arenas:
            arena.release()
        raise
    finally:
        ckpt.close()
        _release_scratch(req)


def _release_scratch(req: LoadRequest) -> None:
    """Give the processing's scratch back to the driver: torch's caching allocator keeps what
    the load used (several GiB for an 8B model) unless emptied, and the daemon's footprint is
    meant to be its arenas (which live outside that pool) and its CUDA context."""
    if any(p.kind is DeviceKind.cuda for p in req.placements):
        torch.cuda.empty_cache()

"""Loading one model into arenas: plan every rank, check the budget, allocate, process, checksum,
and describe the result. Any failure releases everything it allocated, so a model that fails to
load holds no memory.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing import ModelPlan, TensorSpec, execute_plan, plan_model
from protocol.checksum import storage_checksum
from protocol.devices import Placement
from protocol.dtypes import to_wire
from protocol.errors import InsufficientMemoryError
from protocol.schemas.manifest import (
    CheckpointIdentity,
    DaemonIdentity,
    DeviceKind,
    Manifest,
    TensorEntry,
)
from service.memory.arena import Arena, allocate_arena
from service.memory.layout import pack

log = logging.getLogger(__name__)


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
    manifest_json: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.manifest_json = self.manifest.model_dump_json().encode()


@dataclass(frozen=True)
class LoadRequest:
    model_id: str
    path: Path
    tp_size: int
    placements: list[Placement]
    shm_dir: Path
    daemon: DaemonIdentity
    # Claims bytes of the daemon's memory budget for this load; raises if they do not fit.
    reserve: Callable[[int], None]
    # Told what the checkpoint is as soon as it opened (engines match models by fingerprint),
    # and again with the full-tier digest once every byte was read.
    opened: Callable[[CheckpointIdentity], None]


class _Writer:
    """Hands the processing code somewhere to write each tensor, and after each layer checksums
    it and, on a GPU, uploads it from a host staging buffer."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.on_host = arena.device.kind is DeviceKind.cpu
        self.pending: dict[str, tuple[TensorSpec, torch.Tensor]] = {}
        self.checksums: dict[str, str] = {}

    def storage_for(self, spec: TensorSpec) -> torch.Tensor:
        if spec.name not in self.pending:
            buf = (
                self.arena.storage(spec)
                if self.on_host
                else torch.empty(spec.storage_shape, dtype=spec.dtype)
            )
            self.pending[spec.name] = (spec, buf)
        return self.pending[spec.name][1]

    def flush(self) -> None:
        for name, (spec, buf) in self.pending.items():
            self.checksums[name] = storage_checksum(buf)
            if not self.on_host:
                self.arena.storage(spec).copy_(buf)
        self.pending.clear()


def _check_budget(req: LoadRequest, needed: int) -> None:
    req.reserve(needed)
    for placement in set(req.placements):
        if placement.kind is DeviceKind.cuda:
            assert placement.index is not None
            free, _ = torch.cuda.mem_get_info(placement.index)
            share = needed * req.placements.count(placement) // len(req.placements)
            if share > free:
                raise InsufficientMemoryError(
                    f"model needs {share} bytes on GPU {placement.index}, {free} free",
                    needed=share,
                    available=free,
                )
        else:
            free = shutil.disk_usage(req.shm_dir).free
            if needed > free:
                raise InsufficientMemoryError(
                    f"model needs {needed} bytes of shared memory, {req.shm_dir} has {free}",
                    needed=needed,
                    available=free,
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


def load_model(req: LoadRequest, progress: Progress) -> list[ResidentRank]:
    """Load every rank of a model; raises a typed error and holds nothing on failure."""
    arenas: list[Arena] = []
    ckpt = Checkpoint.open(req.path)
    identity = CheckpointIdentity(
        path=str(ckpt.path),
        fingerprint=ckpt.fingerprint,
        digests=ckpt.digests,
        architecture=ckpt.dims.architecture,
        quant_algo=ckpt.quant.quant_algo,
        kv_cache_quant_algo=ckpt.quant.kv_cache_quant_algo,
    )
    req.opened(identity)
    try:
        plans = [plan_model(ckpt, req.tp_size, rank) for rank in range(req.tp_size)]
        layouts = [pack(plan.specs) for plan in plans]
        progress.bytes_total = sum(plan.total_bytes for plan in plans)
        progress.tensors_total = sum(len(plan.specs) for plan in plans)
        _check_budget(req, sum(layout.nbytes for layout in layouts))
        processed: list[tuple[ModelPlan, Arena, dict[str, str]]] = []
        last_log = time.monotonic()

        def stop() -> None:
            if progress.cancelled.is_set():
                raise LoadCancelled(f"model {req.model_id} was unloaded while loading")

        for plan, layout, placement in zip(plans, layouts, req.placements, strict=True):
            label = f"{req.model_id}-r{plan.tp_rank}"
            arena = allocate_arena(layout, placement, req.shm_dir, req.daemon.boot_id, label)
            arenas.append(arena)
            writer = _Writer(arena)

            def advance(nbytes: int, ntensors: int, writer: _Writer = writer) -> None:
                nonlocal last_log
                writer.flush()
                progress.bytes_done += nbytes
                progress.tensors_done += ntensors
                stop()
                if time.monotonic() - last_log > 2.0:
                    last_log = time.monotonic()
                    log.info(
                        "loading %s: %.0f%% (%d/%d bytes, %d/%d tensors)",
                        req.model_id,
                        100 * progress.bytes_done / max(1, progress.bytes_total),
                        progress.bytes_done,
                        progress.bytes_total,
                        progress.tensors_done,
                        progress.tensors_total,
                    )

            execute_plan(ckpt, plan, writer.storage_for, advance)
            if placement.kind is DeviceKind.cuda:
                torch.cuda.synchronize(placement.index)
            processed.append((plan, arena, writer.checksums))
        # The full identity tier, while the files are still in the page cache from processing.
        identity = identity.model_copy(
            update={"digests": ckpt.digests.model_copy(update={"full": ckpt.full_digest(stop)})}
        )
        req.opened(identity)
        return [
            ResidentRank(arena, _manifest(req, identity, plan, arena, checksums))
            for plan, arena, checksums in processed
        ]
    except BaseException:
        for arena in arenas:
            arena.release()
        raise
    finally:
        ckpt.close()

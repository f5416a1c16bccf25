"""The daemon's records as the keeper keeps them, and back."""

from __future__ import annotations

import os

from service.keeper.messages import KeptArena, KeptLease, KeptModel
from service.memory.arena import ShmArena, VmmArena
from service.registry.leases import Lease
from service.registry.models import ModelRecord


def keepable(record: ModelRecord) -> bool:
    """Whether every arena of ``record`` can outlive this process (descriptor-passed ones:
    shareable CUDA allocations and shared-memory files, not legacy IPC)."""
    return bool(record.ranks) and all(
        isinstance(rank.arena, VmmArena | ShmArena) and rank.arena.share_fd() is not None
        for rank in record.ranks
    )


def kept_model(record: ModelRecord) -> tuple[KeptModel, list[int]]:
    """``record`` for the keeper, and duplicates of its arenas' descriptors (rank order), which
    the caller hands on or closes. Call under the daemon's lock, on a keepable record."""
    assert record.checkpoint is not None
    arenas, fds = [], []
    for rank in record.ranks:
        arena = rank.arena
        fd = arena.share_fd()
        assert fd is not None
        fds.append(os.dup(fd))
        arenas.append(
            KeptArena(
                rank=rank.manifest.tp_rank,
                kind="cuda_fd" if isinstance(arena, VmmArena) else "shm",
                nbytes=arena.nbytes,
                allocation_size=(
                    arena.allocation_size if isinstance(arena, VmmArena) else arena.nbytes
                ),
                shm_name=arena.path.name if isinstance(arena, ShmArena) else None,
                shm_dir=str(arena.path.parent) if isinstance(arena, ShmArena) else None,
                boot_id=arena.boot_id
                if isinstance(arena, ShmArena)
                else rank.manifest.daemon.boot_id,
                digest=rank.digest,
            )
        )
    model = KeptModel(
        id=record.id,
        path=str(record.path),
        tp_size=record.tp_size,
        checkpoint=record.checkpoint,
        load_seconds=record.load_seconds,
        manifests=[rank.manifest_json.decode() for rank in record.ranks],
        arenas=arenas,
    )
    return model, fds


def kept_lease(lease: Lease) -> KeptLease:
    return KeptLease.model_validate(lease.record())


def lease_from_kept(kept: KeptLease) -> Lease:
    return Lease.from_record(kept.model_dump())

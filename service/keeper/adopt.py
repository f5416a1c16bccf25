"""A new daemon taking over what the keeper held: every model ready again from its arenas'
descriptors, without reading the checkpoint's weights, once the checkpoint's files are still
those loaded (``files`` tier: a ``stat`` each) and each arena's bytes check out.

A GPU arena is checked against the digest taken on the GPU at load (``service.memory.digest``:
milliseconds for gigabytes); a shared-memory arena against the manifest's per-tensor xxh3. An
arena that cannot be mapped, or whose bytes changed, is let go (the model will load again from
its checkpoint if asked for); nothing half-adopted stays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from modelopt_fp8.checkpoint import IdentityTier
from modelopt_fp8.checkpoint.fingerprint import checkpoint_fingerprint
from protocol.checksum import storage_checksum
from protocol.devices import cuda_index_for_uuid, host_id
from protocol.errors import WeightCacheError
from protocol.logsafe import get_logger
from protocol.schemas.manifest import DeviceKind, Manifest
from protocol.schemas.models import ModelState
from service.keeper.link import ArenaFds
from service.keeper.messages import KeptArena, KeptModel, Snapshot
from service.memory.arena import Arena, ShmArena, VmmArena
from service.memory.digest import arena_digest
from service.memory.layout import ArenaLayout
from service.memory.shm import ArenaDir, ShmFile, remove_if_held
from service.registry.loader import Progress, ResidentRank
from service.registry.models import ModelRecord

log = get_logger("service.daemon")


class NotAdopted(Exception):
    """Why an arena (and so its model) cannot be taken over."""


def _arena(kept: KeptArena, manifest: Manifest, fd: int, arena_dir: ArenaDir | None) -> Arena:
    layout = ArenaLayout({t.name: t.offset for t in manifest.tensors}, kept.nbytes)
    device = manifest.device
    if kept.kind == "cuda_fd":
        index = cuda_index_for_uuid(device.uuid or "")
        if index is None:
            raise NotAdopted(f"GPU {device.uuid} is not visible to this daemon")
        device = device.model_copy(update={"index": index})
        return VmmArena.adopt(layout, device, index, fd, kept.allocation_size)
    if device.kind is not DeviceKind.cpu or device.uuid != host_id():
        raise NotAdopted(f"the arena is of {device.uuid}, not of this host")
    if arena_dir is None or kept.shm_name is None:
        raise NotAdopted("no shared-memory arena directory")
    shm = ShmFile.adopt(arena_dir, kept.shm_name, fd, kept.nbytes)
    return ShmArena.adopt(layout, device, shm, kept.boot_id)


def _check(rank: ResidentRank, kept: KeptArena) -> None:
    if isinstance(rank.arena, VmmArena):
        if kept.digest is None:
            raise NotAdopted("no digest was taken at load")
        if arena_digest(rank.arena.base) != kept.digest:
            raise NotAdopted("its bytes changed since the load (digest differs)")
        return
    base = rank.arena.base
    for entry in rank.manifest.tensors:
        if storage_checksum(base[entry.offset : entry.offset + entry.nbytes]) != entry.checksum:
            raise NotAdopted(f"tensor {entry.name} no longer matches its checksum")


def _check_checkpoint(kept: KeptModel) -> None:
    """The checkpoint on disk is still the one loaded, by the ``files`` tier (a ``stat`` per
    file, no tensor read): weights replaced on disk are loaded again, not adopted."""
    try:
        now = checkpoint_fingerprint(Path(kept.path), IdentityTier.files).digest
    except WeightCacheError as exc:
        raise NotAdopted(f"its checkpoint cannot be checked: {exc.detail}") from exc
    if now != kept.checkpoint.digests.files:
        raise NotAdopted(f"its checkpoint {kept.path} changed on disk since the load")


def adopt_model(kept: KeptModel, fds: ArenaFds, arena_dir: ArenaDir | None) -> ModelRecord:
    """``kept`` as a ready record, its arenas mapped and checked; the descriptors it uses are
    taken from ``fds``. Raises :class:`NotAdopted` with nothing held."""
    ranks: list[ResidentRank] = []
    try:
        _check_checkpoint(kept)
        for arena, manifest_json in zip(kept.arenas, kept.manifests, strict=True):
            fd = fds.pop((kept.id, arena.rank), None)
            if fd is None:
                raise NotAdopted(f"the keeper sent no descriptor for rank {arena.rank}")
            try:
                manifest = Manifest.model_validate_json(manifest_json)
                adopted = _arena(arena, manifest, fd, arena_dir)
            except BaseException:
                os.close(fd)
                raise
            ranks.append(ResidentRank(adopted, manifest, arena.digest))
            _check(ranks[-1], arena)
    except (WeightCacheError, ValidationError, ValueError, OSError) as exc:
        for rank in ranks:
            rank.arena.release()
        raise NotAdopted(str(exc)) from exc
    except BaseException:
        for rank in ranks:
            rank.arena.release()
        raise
    # Ready as loaded: its progress is complete (every tensor of every rank in place), not 0/0.
    tensors = [t for rank in ranks for t in rank.manifest.tensors]
    nbytes = sum(t.nbytes for t in tensors)
    return ModelRecord(
        id=kept.id,
        path=Path(kept.path),
        tp_size=kept.tp_size,
        state=ModelState.ready,
        progress=Progress(
            bytes_total=nbytes,
            bytes_done=nbytes,
            tensors_total=len(tensors),
            tensors_done=len(tensors),
        ),
        ranks=ranks,
        checkpoint=kept.checkpoint,
        load_seconds=kept.load_seconds,
        reserved_bytes=sum(a.nbytes for a in kept.arenas),
        donation=any(rank.manifest.donation is not None for rank in ranks),
    )


def _remove_files(kept: KeptModel, fds: ArenaFds) -> None:
    """The shared-memory files of a model not taken over (those no adopted arena removed on
    release): nobody else will, once the keeper lets go of them."""
    for arena in kept.arenas:
        fd = fds.pop((kept.id, arena.rank), None)
        if fd is None:
            continue
        if arena.shm_dir and arena.shm_name:
            remove_if_held(Path(arena.shm_dir) / arena.shm_name, fd)
        os.close(fd)


def adopt_models(
    snapshot: Snapshot,
    fds: ArenaFds,
    arena_dir: ArenaDir | None,
    let_go: Callable[[str], None],
) -> list[ModelRecord]:
    """Every model of ``snapshot`` that checks out, ready; ``let_go`` is told each one that does
    not (the keeper drops it). Every descriptor in ``fds`` is used or closed."""
    adopted = []
    try:
        for kept in snapshot.models:
            start = time.monotonic()
            try:
                record = adopt_model(kept, fds, arena_dir)
            except NotAdopted as exc:
                log.error(
                    "not adopting %s from the keeper: %s; it loads again if asked for", kept.id, exc
                )
                _remove_files(kept, fds)
                let_go(kept.id)
                continue
            adopted.append(record)
            log.info(
                "adopted %s from the keeper: %d bytes ready in %.3f s, checksums verified, no "
                "checkpoint read",
                record.id,
                record.bytes_resident,
                time.monotonic() - start,
            )
    finally:
        for fd in fds.values():
            os.close(fd)
        fds.clear()
    return adopted

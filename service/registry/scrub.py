"""The scrub: re-check every ready model's arenas against the per-tensor checksums taken when
they were written, and fail a model whose bytes changed since (no new leases; its error says
``arena_corrupted``). Leases already granted keep the arena: engines holding it decide for
themselves, and its memory stays claimed until the model is unloaded."""

from __future__ import annotations

import torch

from protocol.checksum import storage_checksum
from protocol.errors import ArenaCorruptedError
from protocol.logsafe import get_logger
from protocol.schemas.manifest import Manifest
from protocol.schemas.models import ModelState
from service.registry.model_table import ModelTable
from service.registry.models import ModelRecord

log = get_logger("service.daemon")  # the name operators filter the daemon's lines by


# A rank's manifest and its bytes, taken under the lock: the reference keeps the memory mapped
# while it is hashed, even if the model is unloaded meanwhile.
RankBytes = tuple[Manifest, torch.Tensor]


def changed_tensor(ranks: list[RankBytes]) -> ArenaCorruptedError | None:
    """The first tensor whose bytes no longer match their checksum, as the error to fail its
    model with. Hashes every resident byte: never under the daemon's lock."""
    for manifest, base in ranks:
        for entry in manifest.tensors:
            if storage_checksum(base[entry.offset : entry.offset + entry.nbytes]) != entry.checksum:
                return ArenaCorruptedError(
                    f"tensor {entry.name} of rank {manifest.tp_rank} no longer matches its "
                    "checksum: the arena was written after loading; unload and load the model "
                    "again",
                    tensor=entry.name,
                    tp_rank=manifest.tp_rank,
                )
    return None


def scrub(models: ModelTable) -> list[ModelRecord]:
    """Check every ready model once; returns those it failed. Blocking: run it in a thread."""
    with models.lock:
        targets = [
            (record, [(rank.manifest, rank.arena.base) for rank in record.ranks])
            for record in models.records.values()
            if record.state is ModelState.ready
        ]
    failed = []
    for record, ranks in targets:
        error = changed_tensor(ranks)
        if error is None:
            continue
        with models.lock:  # unloaded, or failed otherwise, while it was being hashed: leave it
            if models.records.get(record.id) is not record or record.state is not ModelState.ready:
                continue
            record.fail(error, free_memory=False)
        failed.append(record)
        log.error("model %s failed its scrub: %s", record.id, error)
    return failed

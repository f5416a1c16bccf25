"""Making room: which held models may go when a load or a donation needs memory, or a model
slot, that the daemon does not have, and in what order.

Only donated models are evicted. Any engine of the same configuration donates one again (it
loads with vLLM's default loader, as the first did), whereas a model the daemon loaded was asked
for by name (``/ready`` waits for the startup ones) and is unloaded only by ``DELETE``. A donated
model with an active lease (a serving engine or a sleeping standby) is never evicted; of the
others a failed one goes first, then the one used least recently. The model table carries an
eviction out (:meth:`~service.registry.model_table.ModelTable.evict_until`): the record goes,
the keeper lets go of it and its arena is released, as an unload does.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

from protocol.devices import Placement
from protocol.schemas.models import ModelState
from service.registry.models import ModelRecord


class Pressure(str, enum.Enum):
    """What a model was evicted for."""

    memory_budget = "memory_budget"  # --memory-budget would be exceeded
    max_models = "max_models"  # --max-models are held
    free_memory = "free_memory"  # the device (or the shared-memory directory) lacks the bytes


def evictable(record: ModelRecord, leases: int, placement: Placement | None = None) -> bool:
    """Whether ``record``, with ``leases`` active leases on it, may be evicted (to make room on
    ``placement``: only a model with an arena there frees any)."""
    if not record.donation or record.state is ModelState.loading or leases:
        return False
    return placement is None or record.holds_on(placement)


def eviction_order(
    records: Iterable[ModelRecord],
    leases_on: Callable[[str], int],
    placement: Placement | None = None,
) -> list[ModelRecord]:
    """The models that may be evicted, the first to go first."""
    candidates = [r for r in records if evictable(r, leases_on(r.id), placement)]
    return sorted(candidates, key=lambda r: (r.state is ModelState.ready, r.last_used))

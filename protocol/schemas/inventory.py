"""What the daemon holds, for operators."""

from __future__ import annotations

from pydantic import BaseModel, Field

from protocol.schemas.manifest import DeviceKind
from protocol.schemas.models import ModelInfo


class DeviceInfo(BaseModel):
    kind: DeviceKind
    name: str
    uuid: str | None
    compute_capability: str | None
    total_memory: int = Field(description="bytes; shared-memory capacity on the CPU")
    free_memory: int | None = Field(description="bytes; null when unknown without a CUDA context")
    process_memory: int | None = Field(
        default=None,
        description="bytes of this device the daemon's process holds in all (on a GPU: its CUDA "
        "context, torch's pool and its arenas, per NVML); null when unknown",
    )
    process_memory_source: str = Field(
        default="", description="where process_memory comes from, or why it is unknown"
    )


class Inventory(BaseModel):
    boot_id: str
    version: str
    devices: list[DeviceInfo]
    cache_bytes: int = Field(description="arena bytes held by all models")
    memory_budget: int | None = Field(description="bytes the cache may hold; null if unbounded")
    models: list[ModelInfo]
    active_leases: int

"""What the daemon holds, for operators."""

from __future__ import annotations

from typing import Literal

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


KeeperMode = Literal["auto", "external", "off"]


class KeeperInfo(BaseModel):
    """The process that holds the arenas across the daemon's restarts (``--keeper``)."""

    mode: KeeperMode
    socket: str | None = Field(description="<run-dir>/keeper.sock; null with --keeper off")
    attached: bool = Field(description="the daemon is attached to it now")
    pid: int | None = Field(
        description="its process as the daemon sees it; null when off, or in another PID namespace"
    )
    started_by_daemon: bool = Field(
        description="this daemon started it (--keeper auto): it outlives the daemon, holding "
        "the models for the next one until its idle timeout"
    )


class Inventory(BaseModel):
    boot_id: str
    version: str
    devices: list[DeviceInfo]
    cache_bytes: int = Field(description="arena bytes held by all models")
    memory_budget: int | None = Field(description="bytes the cache may hold; null if unbounded")
    models: list[ModelInfo]
    active_leases: int
    keeper: KeeperInfo | None = Field(default=None, description="null from older daemons")

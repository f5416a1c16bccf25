"""Liveness and readiness."""

from __future__ import annotations

from pydantic import BaseModel, Field

from protocol.schemas.models import ModelState


class Health(BaseModel):
    status: str = Field(default="ok")
    boot_id: str
    version: str
    protocol_version: int
    uptime_s: float


class Readiness(BaseModel):
    ready: bool
    models: dict[str, ModelState] = Field(
        description="every model asked for at start and not unloaded since, and any whose "
        "arena was lost"
    )
    waiting: list[str] = Field(description="still loading")
    failed: dict[str, str] = Field(
        description="model id -> why it failed (blocks readiness unless --keep-going)"
    )

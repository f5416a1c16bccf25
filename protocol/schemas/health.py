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
    """Ready: at least one model held, none loading, none failed (failed ones do not block
    with --keep-going)."""

    ready: bool
    models: dict[str, ModelState] = Field(description="every model the daemon holds")
    waiting: list[str] = Field(description="still loading (asked for at start or over the API)")
    failed: dict[str, str] = Field(
        description="model id -> why it failed (blocks readiness unless --keep-going)"
    )
    reason: str | None = Field(default=None, description="why not ready (null when ready)")

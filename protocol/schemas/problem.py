"""RFC 9457 problem documents: every error response, with a stable ``code``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Problem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = Field(description="urn:weight-cache:problem:<code>")
    title: str
    status: int
    detail: str
    code: str = Field(description="stable machine-readable error code")
    hint: str | None = Field(default=None, description="what to do about it")

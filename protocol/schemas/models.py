"""Models the daemon holds: load requests, states and progress."""

from __future__ import annotations

import enum
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from protocol.hub_cache import snapshot_repo
from protocol.schemas.donated import Donor
from protocol.schemas.manifest import CheckpointDigests
from protocol.schemas.parking import ParkedSummary
from protocol.schemas.tensor_parallel import TpSize
from protocol.schemas.text import PrintableStr

MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def default_model_id(path: Path) -> str:
    """A valid model id made from a checkpoint's directory name; a snapshot of the Hugging Face
    cache (``models--Org--Name/snapshots/<revision>``) is named after its repo, ``Org--Name``
    (the cache's own spelling of ``Org/Name``), not after the revision's hash."""
    real = Path(os.path.realpath(path))  # never raises, even on a symlink loop
    repo = snapshot_repo(real)
    name = real.name if repo is None else repo
    name = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")
    return (name or "model")[:128]


class ModelState(str, enum.Enum):
    loading = "loading"
    ready = "ready"
    failed = "failed"


class LoadModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(
        min_length=1, max_length=4096, pattern=r"^[^\x00]+$", description="checkpoint directory"
    )
    id: str | None = Field(default=None, pattern=MODEL_ID_PATTERN)
    tp_size: TpSize = 1


class LoadProgress(BaseModel):
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int


class ModelError(BaseModel):
    code: str
    detail: PrintableStr
    file: PrintableStr | None = None
    tensor: PrintableStr | None = None


class ModelInfo(BaseModel):
    id: str
    path: PrintableStr
    state: ModelState
    tp_size: int
    progress: LoadProgress
    error: ModelError | None = None
    architecture: str | None = None
    quant_algo: str | None = None
    fingerprint: str | None = Field(
        default=None, description="the checkpoint's sampled-tier digest (digests.sampled)"
    )
    digests: CheckpointDigests | None = Field(
        default=None, description="the checkpoint's identity at every tier, once it opened"
    )
    bytes_resident: int = Field(description="arena bytes held, all ranks")
    tensors: int = Field(description="tensors per rank")
    layers: int = Field(description="linear layers per rank")
    active_leases: int
    load_seconds: float | None = None
    donor: Donor | None = Field(
        default=None,
        description="for a donated model (processed by an engine's vLLM, not by this daemon): "
        "who gave it and when",
    )
    parked: ParkedSummary = Field(
        default_factory=ParkedSummary, description="engines parked to replace this model's"
    )

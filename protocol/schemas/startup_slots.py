"""Start-up slots: engines that share a GPU size their memory one at a time
(``/v1/startup-slots``).

vLLM sizes an engine's KV cache from the free memory it sees change while it profiles; another
engine allocating on the same GPU meanwhile is counted as this one's, and can leave it no room.
An engine holds its GPU's slot from just before vLLM's memory snapshot until its KV cache is
allocated and its graphs are captured.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from protocol.schemas.engine_ranks import ClientPid, EngineGroup
from protocol.schemas.tensor_parallel import TpRank, TpSize

DEVICE_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


class SlotState(str, enum.Enum):
    waiting = "waiting"
    held = "held"


class SlotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    device: str = Field(
        pattern=DEVICE_PATTERN, description="the GPU's UUID (GPU-...), or the host id on the CPU"
    )
    tp_rank: TpRank
    tp_size: TpSize
    client_pid: ClientPid
    group: EngineGroup = Field(
        description="shared by the TP ranks of one engine: their GPUs are granted together"
    )


class SlotTicket(BaseModel):
    id: str
    device: str
    tp_rank: int
    tp_size: int
    group: str
    client_pid: int
    pid_watched: bool
    boot_id: str
    state: SlotState
    asked_at: float = Field(description="unix seconds")
    granted_at: float | None = Field(default=None, description="unix seconds")
    expires_at: float = Field(
        description="unix seconds: a waiting ticket must be asked for again before then; a "
        "held slot is given to the next engine then"
    )
    ahead: int = Field(description="engines waiting for this GPU before this one")

"""Engines waiting to take over (``/v1/parking``): parked ones, started ahead of need and
waiting at their load step, and warm standbys, started all the way (attached, compiled, CUDA
graphs captured, KV cache sized) and asleep, until the daemon releases them."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from protocol.schemas.engine_ranks import ClientPid, EngineGroup
from protocol.schemas.tensor_parallel import TpRank, TpSize

MAX_WAIT_S = 60.0  # longest long-poll of one request


class ParkState(str, enum.Enum):
    parked = "parked"  # waiting to be released
    released = "released"  # go: attach and serve
    cancelled = "cancelled"  # an operator cancelled it: fall back or fail (the engine's option)


class ReleaseCause(str, enum.Enum):
    reaped = "reaped"  # an engine died holding a lease on the same model and rank
    lease_ended = "lease_ended"  # an engine released (or let expire) its lease, then ended
    operator = "operator"  # asked over REST
    unserved = "unserved"  # parked with if_serving while no engine held a lease on the model


class ParkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=128)
    tp_rank: TpRank
    tp_size: TpSize
    client_pid: ClientPid
    group: EngineGroup = Field(
        description="shared by the TP ranks of one engine, which are released together"
    )
    if_serving: bool = Field(
        default=False,
        description="wait only while an engine serves the model: released at once "
        "(cause 'unserved') when none does",
    )
    standby: bool = Field(
        default=False,
        description="a warm standby: an engine that has started and sleeps, registered by "
        "`weight-cache standby`; the leases its engine took under the same group "
        "(standby_group) do not count as serving until it is released",
    )


class ParkedEngine(BaseModel):
    id: str
    model: str
    tp_rank: int
    tp_size: int
    group: str
    standby: bool = Field(default=False, description="a warm standby (asleep), not parked")
    client_pid: int
    pid_watched: bool = Field(description="whether the daemon can see the PID to reap it")
    boot_id: str
    state: ParkState
    parked_at: float = Field(description="unix seconds")
    released_at: float | None = Field(default=None, description="unix seconds")
    cause: ReleaseCause | None = Field(default=None, description="why it was released")
    expires_at: float = Field(
        description="unix seconds; forgotten then unless the engine asks for it again"
    )


class ParkedSummary(BaseModel):
    """A model's parked engines (ranks), as the model's record shows them."""

    count: int = Field(default=0, description="ranks waiting (an engine at TP n waits as n)")
    standby: int = Field(default=0, description="of those, ranks of warm standbys (asleep)")
    since: float | None = Field(default=None, description="unix seconds the oldest parked")
    pids: list[int] = Field(default_factory=list, description="their processes")

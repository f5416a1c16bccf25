"""Lease requests and grants."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from protocol.schemas.engine_ranks import GROUP_PATTERN, ClientPid
from protocol.schemas.manifest import ArenaDescriptor, Manifest
from protocol.schemas.tensor_parallel import TpRank, TpSize

MAX_TTL_S = 86_400.0
_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "0" is not 0, true is not 1.0

    model: str = Field(min_length=1, max_length=128)
    tp_rank: TpRank
    tp_size: TpSize
    kernel: str = Field(
        pattern=_NAME, description="the kernel the engine selected; the daemon serves 'cutlass'"
    )
    format: str = Field(
        pattern=_NAME, description="the weight format the engine expects; 'default' is served"
    )
    client_pid: ClientPid
    ttl_s: float | None = Field(default=None, gt=0, le=MAX_TTL_S)
    known_layout: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description="layout_digest of a manifest the client already holds for this model/rank",
    )
    standby_group: str | None = Field(
        default=None,
        pattern=GROUP_PATTERN,
        description="the group of the warm standby this engine starts as (`weight-cache "
        "standby`): the lease does not count as serving the model until the standby of that "
        "group is released",
    )


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    ttl_s: float | None = Field(default=None, gt=0, le=MAX_TTL_S)


class LeaseInfo(BaseModel):
    id: str
    model: str
    tp_rank: int
    tp_size: int
    client_pid: int = Field(description="the process the request named")
    holder_uid: int | None = Field(
        default=None,
        description="the user holding the lease, as the kernel proved it (peer credentials); "
        "null for a remote token holder",
    )
    holder_pid: int | None = Field(
        default=None,
        description="the process whose end ends the lease (client_pid, or the Unix-socket peer "
        "that asked); null when it is in another PID namespace (the TTL alone ends the lease)",
    )
    pid_watched: bool = Field(description="whether the daemon watches holder_pid to reap it")
    boot_id: str
    granted_at: float = Field(description="unix seconds")
    expires_at: float = Field(description="unix seconds")
    ttl_s: float
    renewals: int
    standby_group: str | None = Field(
        default=None,
        description="set while the lease is a warm standby's that has not been released: it "
        "does not count as serving the model, and its end releases no waiting engine",
    )


class LeaseGrant(BaseModel):
    lease: LeaseInfo
    layout_digest: str
    arenas: list[ArenaDescriptor] = Field(
        description="this lease's handles, exported afresh; tensors name them by index"
    )
    manifest: Manifest | None = Field(
        description="null when the request's known_layout equals layout_digest: the client "
        "reuses the manifest it holds"
    )

    def full_manifest(self) -> Manifest:
        """The manifest (the client library always fills it in before returning a grant)."""
        if self.manifest is None:
            raise ValueError("grant without a manifest: its layout was cached by the client")
        return self.manifest

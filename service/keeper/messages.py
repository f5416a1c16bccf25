"""What the daemon and its keeper say to each other over ``<run_dir>/keeper.sock``.

The daemon attaches and gets a snapshot of what the keeper holds (then each arena's descriptor
in a message of its own), and from then on journals every change: a model ready (its arenas'
descriptors first, one message each) or gone, a lease granted or ended. Journal messages get no
answer, so a grant never waits on the keeper.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.schemas.manifest import CheckpointIdentity

MAX_MESSAGE_BYTES = 256 << 20
# Raised when these messages change; a daemon and a keeper of different versions do not attach.
KEEPER_PROTOCOL = 1


class _Strict(BaseModel):
    """Every keeper message and record: a field either side does not know is refused."""

    model_config = ConfigDict(extra="forbid")


class KeptArena(_Strict):
    """One rank's arena: where it lives and how to check it."""

    rank: int
    kind: Literal["cuda_fd", "shm"]
    nbytes: int
    allocation_size: int
    shm_name: str | None = None  # the file's name in the daemon's arena directory
    shm_dir: str | None = None  # that directory (the keeper removes what it lets go of alone)
    boot_id: str = Field(description="boot id of the daemon that made it")
    digest: str | None = Field(description="service.memory.digest of the arena, at load")


class KeptModel(_Strict):
    id: str
    path: str
    tp_size: int
    checkpoint: CheckpointIdentity
    load_seconds: float | None
    manifests: list[str] = Field(description="each rank's manifest JSON, as rendered at load")
    arenas: list[KeptArena]


class KeptLease(_Strict):
    id: str
    model: str
    tp_rank: int
    tp_size: int
    client_pid: int
    holder_uid: int | None
    holder_pid: int | None
    pid_start: int | None
    granted_at: float
    expires_at: float
    ttl_s: float
    renewals: int
    secret: str
    standby_group: str | None = None


class Attach(_Strict):
    """A daemon taking the keeper over; ``resync``: forget what is held, a snapshot follows."""

    op: Literal["attach"] = "attach"
    protocol: int = KEEPER_PROTOCOL
    pid: int
    boot_id: str
    resync: bool = False


class Snapshot(_Strict):
    """What the keeper holds; each arena's descriptor follows in an ``ArenaFd``, in order."""

    op: Literal["snapshot"] = "snapshot"
    models: list[KeptModel]
    leases: list[KeptLease]


class ArenaFd(_Strict):
    """Carries one arena's descriptor (``SCM_RIGHTS``)."""

    op: Literal["arena_fd"] = "arena_fd"
    model: str
    rank: int


class PutModel(_Strict):
    """A model ready: its ``ArenaFd`` messages came just before."""

    op: Literal["put_model"] = "put_model"
    model: KeptModel


class DropModel(_Strict):
    op: Literal["drop_model"] = "drop_model"
    model: str


class PutLease(_Strict):
    op: Literal["put_lease"] = "put_lease"
    lease: KeptLease


class DropLease(_Strict):
    op: Literal["drop_lease"] = "drop_lease"
    lease: str


class Status(_Strict):
    op: Literal["status"] = "status"


class StatusReply(_Strict):
    op: Literal["status_reply"] = "status_reply"
    pid: int
    daemon_pid: int | None
    models: list[str]
    arenas: int
    leases: int
    idle_timeout_s: float | None = Field(
        default=None, description="how long it waits for a daemon before it lets go (0: ever)"
    )


class Refused(_Strict):
    op: Literal["refused"] = "refused"
    detail: str


Message = Annotated[
    Attach
    | Snapshot
    | ArenaFd
    | PutModel
    | DropModel
    | PutLease
    | DropLease
    | Status
    | StatusReply
    | Refused,
    Field(discriminator="op"),
]


class Envelope(_Strict):
    """Any message (the reader's type: one model for every op)."""

    message: Message

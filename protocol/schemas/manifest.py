"""The lease manifest: everything an engine needs to rebuild and trust the leased tensors without
re-running any transform. Handles are JSON (named fields, bytes in base64), never pickle."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from protocol.dtypes import to_torch
from protocol.schemas.donated import Donated
from protocol.schemas.layout import CarriedLayout, LayerLayout, WireDType
from protocol.schemas.text import PrintableStr

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class DeviceKind(str, enum.Enum):
    cuda = "cuda"
    cpu = "cpu"  # host shared memory under /dev/shm, the CPU twin of CUDA IPC


class DaemonIdentity(BaseModel):
    model_config = _FROZEN

    boot_id: str = Field(
        description="random per daemon start; in a manifest, the daemon that processed the "
        "arena (a later daemon may have taken it over: leases name the one answering now)"
    )
    protocol_version: int
    weight_cache_version: str
    torch_version: str


class DeviceIdentity(BaseModel):
    model_config = _FROZEN

    kind: DeviceKind
    name: str
    uuid: str | None = Field(description="GPU UUID (GPU-xxxxxxxx-...); null on the CPU")
    compute_capability: str | None = Field(description="e.g. '9.0'; null on the CPU")
    index: int | None = Field(description="the daemon's own CUDA index; engines map by uuid")


class CheckpointDigests(BaseModel):
    """The checkpoint's identity at every tier (``modelopt_fp8.checkpoint.fingerprint``); an engine
    compares the one tier it chose against its own copy."""

    model_config = _FROZEN

    files: str = Field(
        description="sha256 over name, device, inode, size and mtime_ns of every file loaded"
    )
    sampled: str = Field(
        description="sha256 over configs, sizes, safetensors headers and a few KiB of every "
        "tensor's data at fixed positions (the default tier)"
    )
    hf_blob: str | None = Field(
        description="sha256 over the Hugging Face blob ids; null outside a Hugging Face cache"
    )
    full: str | None = Field(
        description="xxh3-128 over every byte; null until the load has read them all"
    )

    def of(self, tier: str) -> str | None:
        """The digest of ``tier`` (a tier name)."""
        value: str | None = getattr(self, tier)
        return value


class CheckpointIdentity(BaseModel):
    model_config = _FROZEN

    path: PrintableStr = Field(description="where the daemon read it (odd bytes escaped)")
    fingerprint: str = Field(description="the sampled-tier digest (digests.sampled)")
    digests: CheckpointDigests
    architecture: str
    quant_algo: str
    kv_cache_quant_algo: str | None


class CudaIpcHandle(BaseModel):
    """The fields of ``torch.multiprocessing.reductions.reduce_tensor`` for the arena's byte
    tensor, exported afresh for this lease (so torch's IPC reference count sees each consumer)."""

    model_config = _FROZEN

    kind: Literal["cuda_ipc"] = "cuda_ipc"
    device_uuid: str
    storage_handle: str = Field(description="cudaIpcMemHandle of the allocator block, base64")
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str = Field(description="name of torch's IPC ref-counter file, base64")
    ref_counter_offset: int
    event_handle: str | None = Field(description="cudaIpcEventHandle, base64")
    event_sync_required: bool
    tensor_offset: int = Field(description="arena start within the storage, in bytes")
    tensor_size: int = Field(description="arena length in bytes")


class HandleAccess(BaseModel):
    """How this lease's holder asks the daemon's handle socket for the arena's descriptor: the
    socket (answering only the lease's holder, by peer credentials) and the lease's secret."""

    model_config = _FROZEN

    socket: str = Field(description="the daemon's handle socket, <run_dir>/handles.sock")
    secret: str = Field(description="this lease's secret, presented with the lease's id")


class ShmHandle(BaseModel):
    """A file under /dev/shm holding the arena; the engine maps it read-only, from the
    descriptor the handle socket passes when ``access`` is given and the socket answers, else
    from the path."""

    model_config = _FROZEN

    kind: Literal["shm"] = "shm"
    path: str
    size: int
    boot_id: str
    access: HandleAccess | None = None


class CudaFdHandle(BaseModel):
    """A shareable CUDA allocation (``cuMemCreate``), passed as a POSIX file descriptor by the
    daemon's handle socket (``SCM_RIGHTS``) to the lease's holder, who imports and maps it."""

    model_config = _FROZEN

    kind: Literal["cuda_fd"] = "cuda_fd"
    device_uuid: str
    allocation_size: int = Field(description="bytes of the allocation (granularity multiple)")
    size: int = Field(description="arena bytes, from the allocation's start")
    access: HandleAccess


ArenaHandle = Annotated[CudaIpcHandle | ShmHandle | CudaFdHandle, Field(discriminator="kind")]


class ArenaDescriptor(BaseModel):
    model_config = _FROZEN

    index: int
    nbytes: int
    handle: ArenaHandle


class TensorEntry(BaseModel):
    model_config = _FROZEN

    name: str = Field(description="vLLM parameter name")
    arena: int
    offset: int = Field(
        description="byte offset of the tensor's storage in the arena (256-aligned)"
    )
    nbytes: int
    dtype: WireDType
    shape: list[int]
    stride: list[int] = Field(description="in elements, from the storage start")
    checksum: str = Field(description="xxh3-64 of the storage bytes, hex")

    def storage(self, base: torch.Tensor) -> torch.Tensor:
        """This tensor's contiguous storage inside the arena's byte tensor ``base``, typed."""
        return base[self.offset : self.offset + self.nbytes].view(to_torch(self.dtype))

    def view(self, base: torch.Tensor) -> torch.Tensor:
        """The tensor the manifest describes, a zero-copy view into ``base`` (the one place a
        leased view is rebuilt from its entry)."""
        return self.storage(base).as_strided(self.shape, self.stride)


class Manifest(BaseModel):
    """What one TP rank of one model holds, and where."""

    model_config = _FROZEN

    model: str
    tp_rank: int
    tp_size: int
    daemon: DaemonIdentity
    device: DeviceIdentity
    checkpoint: CheckpointIdentity
    tensors: list[TensorEntry]
    layers: list[LayerLayout]
    carried: list[CarriedLayout] = Field(
        default_factory=list,
        description="every tensor outside the linear layers: embeddings, lm_head, norms, KV scales",
    )
    donation: Donated | None = Field(
        default=None,
        description="set for a donated model: its key, the state an engine sets beside the "
        "tensors, and its donor",
    )
    layout_digest: str = Field(
        description="xxh3-128 of all of the above; a client holding this layout sends it back "
        "as known_layout and gets only the lease and fresh handles"
    )

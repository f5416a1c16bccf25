"""Arenas: one contiguous allocation per model and TP rank holding every processed tensor, so an
engine opens one handle per arena, not one per tensor.

On CUDA the arena is a shareable allocation passed to engines as a file descriptor
(``vmm_arena.VmmArena``, ``--cuda-handles fd``), or a plain device allocation exported over
legacy CUDA IPC (``--cuda-handles ipc``; never an expandable segment: opening those costs time
proportional to their size). On the CPU it is a shared-memory file. Either way every tensor is a
256-byte-aligned view into it.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path

import torch

from modelopt_fp8.processing.tensor_spec import TensorSpec
from protocol import cuda_vmm
from protocol.cuda_ipc import export_cuda_arena
from protocol.cuda_vmm import DeviceMapping
from protocol.devices import Placement
from protocol.errors import InsufficientMemoryError, ShmDirError
from protocol.schemas.manifest import (
    ArenaHandle,
    CudaFdHandle,
    DeviceIdentity,
    DeviceKind,
    HandleAccess,
    ShmHandle,
)
from service.memory.layout import ArenaLayout
from service.memory.shm import ArenaDir, ShmFile


def storage_view(base: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """The contiguous storage of ``spec`` inside the byte tensor ``base``, at ``offset``."""
    raw = base[offset : offset + spec.nbytes]
    return raw.view(spec.dtype).view(spec.storage_shape)


class Arena(abc.ABC):
    """A byte range that holds one rank's tensors."""

    def __init__(self, layout: ArenaLayout, device: DeviceIdentity) -> None:
        self.layout = layout
        self.device = device

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    @abc.abstractmethod
    def base(self) -> torch.Tensor:
        """The whole arena as a 1-D uint8 tensor."""

    def storage(self, spec: TensorSpec) -> torch.Tensor:
        return storage_view(self.base, self.layout.offsets[spec.name], spec)

    @abc.abstractmethod
    def export(self, access: HandleAccess | None) -> ArenaHandle:
        """A handle for one lease (fresh per lease on CUDA), naming ``access`` (the handle
        socket and the lease's secret) where the arena is passed as a descriptor."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the memory back (engines holding a mapping keep theirs)."""

    def share_fd(self) -> int | None:
        """The descriptor the keeper holds (None: legacy IPC, which has none)."""
        return None

    def engine_fd(self) -> int | None:
        """A new descriptor for a lease holder (the caller closes it), or None (legacy IPC)."""
        return None

    def donor_fd(self) -> int | None:
        """A new descriptor the donor of a pending donation maps read-write to write it (the
        caller closes it), or None (legacy IPC)."""
        return None

    def detach(self) -> None:
        """Drop this process's hold without giving the memory back: the keeper holds it for
        the next daemon (shutdown with a keeper)."""
        self.release()

    def lost(self) -> str | None:
        """Why engines could no longer open this arena, or None while they can (checked before
        every grant, so that no lease names memory that is gone)."""
        return None


class ShmArena(Arena):
    def __init__(
        self,
        layout: ArenaLayout,
        device: DeviceIdentity,
        directory: ArenaDir,
        boot_id: str,
        label: str,
    ) -> None:
        super().__init__(layout, device)
        self._boot_id = boot_id
        self._file: ShmFile | None = ShmFile(directory, boot_id, label, layout.nbytes)
        st = os.stat(self._file.path)
        # The file this arena holds open, by identity: a path that names another (or no) file
        # later means the arena was removed or replaced under the daemon.
        self._identity = (st.st_dev, st.st_ino)

    @property
    def base(self) -> torch.Tensor:
        assert self._file is not None, "arena released"
        return self._file.tensor

    @property
    def path(self) -> Path:
        assert self._file is not None, "arena released"
        return self._file.path

    @classmethod
    def adopt(
        cls, layout: ArenaLayout, device: DeviceIdentity, shm: ShmFile, boot_id: str
    ) -> ShmArena:
        """An earlier daemon's arena file, adopted (:meth:`ShmFile.adopt`)."""
        self = cls.__new__(cls)
        Arena.__init__(self, layout, device)
        self._boot_id, self._file = boot_id, shm
        st = os.fstat(shm.fd)
        self._identity = (st.st_dev, st.st_ino)
        return self

    @property
    def boot_id(self) -> str:
        """The boot id of the daemon that made the file (part of its name)."""
        return self._boot_id

    def export(self, access: HandleAccess | None) -> ShmHandle:
        return ShmHandle(
            path=str(self.path), size=self.nbytes, boot_id=self._boot_id, access=access
        )

    def share_fd(self) -> int | None:
        return None if self._file is None else self._file.fd

    def engine_fd(self) -> int | None:
        """The file opened afresh, read-only: an engine can map it only read-only, and its
        mapping does not hold the file's lock (which says a daemon or keeper owns the file)."""
        return None if self._file is None else self._file.open_read_only()

    def donor_fd(self) -> int | None:
        return None if self._file is None else self._file.open_read_write()

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def detach(self) -> None:
        if self._file is not None:
            self._file.detach()
            self._file = None

    def lost(self) -> str | None:
        """A ``stat`` of the path against the file held open: removed, replaced or resized."""
        if self._file is None:
            return "released"
        try:
            st = os.stat(self._file.path)
        except FileNotFoundError:
            return f"{self._file.path} was removed"
        except OSError as exc:
            return f"{self._file.path} cannot be read: {exc.strerror}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"{self._file.path} was replaced by another file"
        if st.st_size != self.nbytes:
            return f"{self._file.path} was resized to {st.st_size} bytes, not {self.nbytes}"
        return None


class CudaArena(Arena):
    def __init__(self, layout: ArenaLayout, device: DeviceIdentity, index: int) -> None:
        super().__init__(layout, device)
        try:
            self._base: torch.Tensor | None = torch.empty(
                layout.nbytes, dtype=torch.uint8, device=torch.device("cuda", index)
            )
        except torch.OutOfMemoryError as exc:
            raise InsufficientMemoryError(
                f"GPU {index} cannot hold {layout.nbytes} more bytes", needed=layout.nbytes
            ) from exc

    @property
    def base(self) -> torch.Tensor:
        assert self._base is not None, "arena released"
        return self._base

    def export(self, access: HandleAccess | None) -> ArenaHandle:
        assert self.device.uuid is not None
        return export_cuda_arena(self.base, self.device.uuid)

    def release(self) -> None:
        # torch keeps a block that consumers still reference alive ("limbo") until their
        # reference counts drop; ipc_collect frees what no consumer holds any more.
        self._base = None
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


class VmmArena(Arena):
    """A shareable allocation (``cuMemCreate``), mapped here and wrapped as a torch tensor
    without a copy, outside torch's caching allocator. Its exported descriptor goes to lease
    holders through the handle socket and to the keeper, so the memory outlives this process
    while either holds it (``protocol/cuda_vmm.py``)."""

    def __init__(
        self, layout: ArenaLayout, device: DeviceIdentity, fd: int, mapping: DeviceMapping
    ) -> None:
        super().__init__(layout, device)
        self._fd: int | None = fd
        self.allocation_size = mapping.size
        self._base: torch.Tensor | None = mapping.tensor()[: layout.nbytes]

    @classmethod
    def create(cls, layout: ArenaLayout, device: DeviceIdentity, index: int) -> VmmArena:
        exported, mapping = cuda_vmm.create_exported(index, layout.nbytes)
        return cls(layout, device, exported.fd, mapping)

    @classmethod
    def adopt(
        cls, layout: ArenaLayout, device: DeviceIdentity, index: int, fd: int, size: int
    ) -> VmmArena:
        """An earlier daemon's allocation, from the descriptor the keeper held (now ours)."""
        return cls(layout, device, fd, cuda_vmm.map_fd(fd, size, index, writable=True))

    @property
    def base(self) -> torch.Tensor:
        assert self._base is not None, "arena released"
        return self._base

    def export(self, access: HandleAccess | None) -> CudaFdHandle:
        assert self.device.uuid is not None and access is not None
        return CudaFdHandle(
            device_uuid=self.device.uuid,
            allocation_size=self.allocation_size,
            size=self.nbytes,
            access=access,
        )

    def share_fd(self) -> int | None:
        return self._fd

    def engine_fd(self) -> int | None:
        return None if self._fd is None else os.dup(self._fd)

    def donor_fd(self) -> int | None:
        """The same descriptor as a lease holder's: what the importer maps decides read-only
        or read-write (``cuda_vmm.map_fd``)."""
        return self.engine_fd()

    def release(self) -> None:
        """Close the descriptor and drop the mapping (unmapped once no view of it is left): the
        memory goes back once no engine maps it and the keeper let go of its descriptor."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._base = None


def allocate_arena(
    layout: ArenaLayout,
    placement: Placement,
    arena_dir: ArenaDir | None,
    boot_id: str,
    label: str,
    cuda_handles: str = "fd",
) -> Arena:
    """A new arena for ``layout``: a shared-memory file on the CPU; on a GPU a shareable
    allocation (``cuda_handles`` ``fd``) or a legacy IPC one (``ipc``)."""
    device = placement.identity()
    if placement.kind is DeviceKind.cpu:
        if arena_dir is None:
            raise ShmDirError("no shared-memory arena directory (see --shm-dir)")
        return ShmArena(layout, device, arena_dir, boot_id, label)
    assert placement.index is not None
    if cuda_handles == "fd":
        return VmmArena.create(layout, device, placement.index)
    return CudaArena(layout, device, placement.index)

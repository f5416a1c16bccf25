"""Opening a leased arena in the engine: CUDA IPC on this process's GPU with the leased UUID, or
the shared-memory file mapped read-only."""

from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from service.errors import VerificationError
from service.memory.cuda_ipc import open_cuda_arena
from service.memory.devices import cuda_index_for_uuid
from service.memory.shm import map_read_only
from service.schemas.manifest import ArenaDescriptor, CudaIpcHandle


@dataclass
class OpenedArena:
    base: torch.Tensor  # the whole arena, 1-D uint8, zero-copy
    mapping: mmap.mmap | None = None

    def close(self) -> None:
        del self.base
        if self.mapping is not None:
            with contextlib.suppress(BufferError):  # tensors still alive keep it mapped
                self.mapping.close()


def open_arena(descriptor: ArenaDescriptor) -> OpenedArena:
    handle = descriptor.handle
    if isinstance(handle, CudaIpcHandle):
        index = cuda_index_for_uuid(handle.device_uuid)
        if index is None:
            raise VerificationError(
                f"GPU {handle.device_uuid} is not visible to this process",
                reason="device_mismatch",
                leased=handle.device_uuid,
            )
        return OpenedArena(open_cuda_arena(handle, index))
    base, mapping = map_read_only(Path(handle.path), handle.size)
    return OpenedArena(base, mapping)

"""Opening a leased arena in the engine: CUDA IPC on this process's GPU with the leased UUID, or
the shared-memory file mapped read-only.

Whatever stops the open is raised typed from here: a shared-memory file that is gone, not
readable or of the wrong size is :class:`~protocol.errors.ArenaUnavailableError`; CUDA refusing a
handle (another IPC namespace, a dead daemon, a driver error) is
:class:`~protocol.errors.IpcOpenError`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.cuda_ipc import open_cuda_arena, release_cuda_export
from protocol.devices import cuda_index_for_uuid
from protocol.errors import ArenaUnavailableError, IpcOpenError, VerificationError
from protocol.reasons import Reason
from protocol.schemas.manifest import ArenaDescriptor, ArenaHandle, CudaIpcHandle
from protocol.shm import map_read_only


@dataclass
class OpenedArena:
    """The whole arena as a 1-D uint8 tensor, zero-copy. Every tensor rebuilt from it keeps the
    mapping (IPC or mmap) alive: closing only lets go of this reference, so memory still bound
    to an engine's parameters is never unmapped under them."""

    base: torch.Tensor | None

    def close(self) -> None:
        self.base = None


def release_unopened(handle: ArenaHandle) -> None:
    """Decrement torch's IPC reference count of a CUDA export this process will not open (a
    lease refused on verification). Opening and later dropping the handle does this; without
    either, the daemon could never free that memory after an unload."""
    if isinstance(handle, CudaIpcHandle):
        release_cuda_export(handle)


def open_arena(descriptor: ArenaDescriptor) -> OpenedArena:
    handle = descriptor.handle
    if isinstance(handle, CudaIpcHandle):
        index = cuda_index_for_uuid(handle.device_uuid)
        if index is None:
            raise VerificationError(
                f"GPU {handle.device_uuid} is not visible to this process",
                reason=Reason.device_mismatch,
                leased=handle.device_uuid,
            )
        try:
            return OpenedArena(open_cuda_arena(handle, index))
        except (RuntimeError, ValueError, OSError) as exc:
            raise IpcOpenError(
                f"CUDA cannot open the leased arena on GPU {handle.device_uuid}: {exc} (is the "
                "engine in the daemon's PID and IPC namespaces?)",
                reason=Reason.ipc_open_failed,
                device=handle.device_uuid,
            ) from exc
    try:
        return OpenedArena(map_read_only(Path(handle.path), handle.size))
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ArenaUnavailableError(
            f"cannot map the leased arena {handle.path}: {why} (is /dev/shm shared with the "
            "daemon?)",
            reason=Reason.arena_unavailable,
            file=handle.path,
        ) from exc

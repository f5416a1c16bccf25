"""Opening a leased arena in the engine: a shareable CUDA allocation whose descriptor the
daemon's handle socket passes (imported and mapped read-only on this process's GPU with the
leased UUID), legacy CUDA IPC, or the shared-memory file mapped read-only (from the descriptor
the handle socket passes, else by its path). A donor opens the arena of its pending donation the
same way, mapped read-write (``writable``): the handle socket passes it for the offer's secret.

Whatever stops the open is raised typed from here: a shared-memory file that is gone, not
readable or of the wrong size is :class:`~protocol.errors.ArenaUnavailableError`; the handle
socket refusing this process is :class:`~protocol.errors.HandleRefusedError`; CUDA refusing a
handle or a descriptor (another IPC namespace, a dead daemon, a driver error) is
:class:`~protocol.errors.IpcOpenError`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol import cuda_vmm
from protocol.cuda_ipc import open_cuda_arena, release_cuda_export
from protocol.devices import cuda_index_for_uuid
from protocol.errors import ArenaUnavailableError, IpcOpenError, VerificationError, WeightCacheError
from protocol.handle_socket import SocketUnreachableError, fetch_arena_fd
from protocol.reasons import Reason
from protocol.schemas.manifest import (
    ArenaDescriptor,
    ArenaHandle,
    CudaFdHandle,
    CudaIpcHandle,
    ShmHandle,
)
from protocol.shm import map_fd, map_path


@dataclass
class OpenedArena:
    """The whole arena as a 1-D uint8 tensor, zero-copy. Every tensor rebuilt from it keeps the
    mapping (IPC or mmap) alive: closing only lets go of this reference, so memory still bound
    to an engine's parameters is never unmapped under them."""

    base: torch.Tensor | None
    via: str = "path"  # how it was opened: "descriptor", "cuda_ipc" or "path"
    read_only: bool = True  # a write through this mapping faults (not so for legacy IPC)

    def close(self) -> None:
        self.base = None


def release_unopened(handle: ArenaHandle) -> None:
    """Decrement torch's IPC reference count of a CUDA export this process will not open (a
    lease refused on verification). Opening and later dropping the handle does this; without
    either, the daemon could never free that memory after an unload."""
    if isinstance(handle, CudaIpcHandle):
        release_cuda_export(handle)


def _gpu_index(uuid: str) -> int:
    index = cuda_index_for_uuid(uuid)
    if index is None:
        raise VerificationError(
            f"GPU {uuid} is not visible to this process",
            reason=Reason.device_mismatch,
            leased=uuid,
        )
    return index


def _open_cuda_fd(
    descriptor: ArenaDescriptor,
    handle: CudaFdHandle,
    lease: str,
    socket: str | None,
    writable: bool,
) -> OpenedArena:
    index = _gpu_index(handle.device_uuid)
    fd, size = fetch_arena_fd(handle.access, lease, descriptor.index, socket)
    try:
        if size != handle.allocation_size:
            raise IpcOpenError(
                f"the handle socket passed {size} bytes, the grant says {handle.allocation_size}",
                reason=Reason.ipc_open_failed,
            )
        mapping = cuda_vmm.map_fd(fd, size, index, writable=writable)
        base = mapping.tensor()[: handle.size]
        return OpenedArena(base, via="descriptor", read_only=mapping.read_only)
    except WeightCacheError as exc:
        if isinstance(exc, IpcOpenError):
            raise
        raise IpcOpenError(
            f"CUDA cannot map the leased allocation on GPU {handle.device_uuid}: {exc.detail}",
            reason=Reason.ipc_open_failed,
            device=handle.device_uuid,
        ) from exc
    finally:
        os.close(fd)  # the mapping keeps the allocation


def _open_shm(
    descriptor: ArenaDescriptor,
    handle: ShmHandle,
    lease: str,
    socket: str | None,
    writable: bool,
) -> OpenedArena:
    if handle.access is not None:
        try:
            fd, size = fetch_arena_fd(handle.access, lease, descriptor.index, socket)
        except SocketUnreachableError:
            pass  # no handle socket here: the path may still be shared
        else:
            try:
                mapped = map_fd(fd, handle.size, writable)
                return OpenedArena(mapped, via="descriptor", read_only=not writable)
            except (OSError, ValueError) as exc:
                raise ArenaUnavailableError(
                    f"cannot map the leased arena's descriptor ({size} bytes): {exc}",
                    reason=Reason.arena_unavailable,
                    file=handle.path,
                ) from exc
            finally:
                os.close(fd)
    try:
        return OpenedArena(
            map_path(Path(handle.path), handle.size, writable), read_only=not writable
        )
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ArenaUnavailableError(
            f"cannot map the leased arena {handle.path}: {why} (share the daemon's run "
            "directory or /dev/shm with it)",
            reason=Reason.arena_unavailable,
            file=handle.path,
        ) from exc


def open_arena(
    descriptor: ArenaDescriptor,
    lease: str,
    handle_socket: str | None = None,
    writable: bool = False,
) -> OpenedArena:
    """Map the leased arena of lease ``lease`` in this process, zero copy; ``handle_socket``
    overrides the handle socket's path the grant names (the loader's ``handle_socket``).
    ``writable``: the arena of the pending donation ``lease`` (its model id), for its donor."""
    handle = descriptor.handle
    if isinstance(handle, CudaFdHandle):
        return _open_cuda_fd(descriptor, handle, lease, handle_socket, writable)
    if isinstance(handle, ShmHandle):
        return _open_shm(descriptor, handle, lease, handle_socket, writable)
    if writable:
        raise VerificationError(
            "the daemon offered a legacy CUDA IPC arena, which a donor does not write",
            reason=Reason.donation_refused,
        )
    index = _gpu_index(handle.device_uuid)
    try:
        return OpenedArena(open_cuda_arena(handle, index), via="cuda_ipc", read_only=False)
    except (RuntimeError, ValueError, OSError) as exc:
        raise IpcOpenError(
            f"CUDA cannot open the leased arena on GPU {handle.device_uuid}: {exc} (is the "
            "engine in the daemon's PID and IPC namespaces?)",
            reason=Reason.ipc_open_failed,
            device=handle.device_uuid,
        ) from exc

"""Host shared-memory arenas as an engine opens them: the CPU twin of CUDA IPC.

An engine maps the daemon's arena file read-only (``PROT_READ``): a write through the mapping
faults instead of reaching the daemon's bytes. Only a donor maps the arena of its pending
donation read-write, to write it. The daemon's side (creating, locking, sweeping the
files) is ``service.memory.shm``.
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings
from pathlib import Path

import torch


def byte_tensor(buffer: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        # A read-only mapping is the point; torch warns that it is not writable.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def map_fd(fd: int, nbytes: int, writable: bool = False) -> torch.Tensor:
    """Map ``nbytes`` of the arena file open as ``fd`` (passed by the daemon's handle socket)
    as a byte tensor, read-only unless ``writable`` (a donor's); ``fd`` stays the caller's."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("the descriptor is not of a regular file")
    if st.st_size != nbytes:
        raise ValueError(f"the file holds {st.st_size} bytes, the manifest says {nbytes}")
    return byte_tensor(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, _protection(writable)))


def map_path(path: Path, nbytes: int, writable: bool = False) -> torch.Tensor:
    """Map an arena file in an engine as a byte tensor, read-only unless ``writable`` (a
    donor's). The tensor (and every view of it) keeps the mapping alive; it is unmapped when the
    last one is gone, never under them."""
    access = os.O_RDWR if writable else os.O_RDONLY
    fd = os.open(path, access | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size != nbytes:
            raise ValueError(f"{path} holds {st.st_size} bytes, the manifest says {nbytes}")
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, _protection(writable))
    finally:
        os.close(fd)
    return byte_tensor(mapping)


def _protection(writable: bool) -> int:
    return mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ

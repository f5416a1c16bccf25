"""Host shared-memory arenas: the CPU twin of CUDA IPC.

The daemon creates a file under ``/dev/shm`` named after its boot id, holds an exclusive ``flock``
on it for as long as the arena lives, maps it read-write and writes the processed tensors into
it. A file nobody holds the lock on belongs to a daemon that died: the next daemon removes it
(locks work across PID namespaces and containers sharing /dev/shm, unlike PID checks). An
engine maps it read-only (``PROT_READ``): a write through the mapping faults instead of reaching
the daemon's bytes. Unlinking the file on unload
leaves existing mappings intact, so memory is never freed under an engine.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
from pathlib import Path

from protocol.errors import InsufficientMemoryError
from protocol.shm import byte_tensor

FILE_PREFIX = "weight-cache-"


class ShmFile:
    """A daemon-owned shared-memory file, mapped read-write."""

    def __init__(self, directory: Path, boot_id: str, label: str, nbytes: int) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:80]
        name = f"{FILE_PREFIX}{boot_id}-{safe}-{secrets.token_hex(4)}"
        self.path = directory / name
        self.nbytes = nbytes
        # Create under a name the stale-file sweep ignores, lock, then give it its real name.
        staging = directory / f".{name}"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, nbytes)
            try:  # reserve the pages now: a full tmpfs must fail here, not SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise InsufficientMemoryError(
                    f"cannot reserve {nbytes} bytes in {directory}: {exc.strerror}",
                    needed=nbytes,
                ) from exc
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            staging.rename(self.path)
        except BaseException:
            os.close(fd)
            staging.unlink(missing_ok=True)
            raise
        self._fd = fd  # held open: the lock says a live daemon owns this file
        self.tensor = byte_tensor(self._map)
        del self._map  # the tensor holds the mapping; it is unmapped with the last view

    def close(self) -> None:
        """Unlink and drop the mapping (unmapped once no view of it is left); engines that
        mapped the file keep their pages until they unmap."""
        del self.tensor
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


def remove_stale_files(directory: Path) -> list[Path]:
    """Delete arena files left by daemons that are no longer running."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in directory.glob(f"{FILE_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live daemon holds it
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed

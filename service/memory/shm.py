"""Host shared-memory arenas: the CPU twin of CUDA IPC.

Arena files live in a directory of the daemon's own under the shared-memory root
(``/dev/shm/weight-cache-u<uid>``, mode 0700; 0750 and group-owned with ``--shm-group``), are
created exclusively with mode 0600 (0640), and are written through a read-write mapping. Other
users can neither list nor read them; engines of the daemon's user (or its group) map them
read-only (``PROT_READ``): a write through the mapping faults instead of reaching the daemon's
bytes, and the scrub (``--scrub-interval``) notices bytes changed any other way.

The daemon holds an exclusive ``flock`` on each file for as long as the arena lives. A file
nobody holds the lock on belongs to a daemon that died: the next daemon removes it (locks work
across PID namespaces and containers sharing /dev/shm, unlike PID checks). Cleanup only touches
regular files its user owns, opened without following links and without blocking, so a planted
FIFO or symlink cannot stall or redirect it. Unlinking the file on unload leaves existing mappings
intact, so memory is never freed under an engine.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

from protocol.errors import InsufficientMemoryError, ShmDirError
from protocol.shm import byte_tensor
from service.private_dir import claim

FILE_PREFIX = "weight-cache-"
_STAGING_PREFIX = "." + FILE_PREFIX
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def arena_dir_path(root: Path, uid: int | None = None) -> Path:
    """The directory a daemon running as ``uid`` keeps its arenas in, under ``root``."""
    return Path(root) / f"{FILE_PREFIX}u{os.geteuid() if uid is None else uid}"


def group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise ShmDirError(f"no group named {group!r}") from None


NOT_OURS = (
    "{path} belongs to uid {owner}, not to this daemon's user ({uid}): remove it or use "
    "another --shm-dir"
)


class ArenaDir:
    """The daemon's private arena directory, opened once; files are made relative to it."""

    def __init__(self, fd: int, path: Path, gid: int | None) -> None:
        self.fd = fd
        self.path = path
        self.gid = gid
        self.file_mode = 0o640 if gid is not None else 0o600

    @classmethod
    def prepare(cls, root: Path, group: str | None = None) -> ArenaDir:
        """Create (or adopt) the directory: ours, not a link, mode 0700 (0750 for a group)."""
        gid = group_id(group)
        path = arena_dir_path(root)
        try:
            root_fd = os.open(root, _DIR_FLAGS)
        except OSError as exc:
            raise ShmDirError(f"cannot open {root}: {exc.strerror}", path=str(root)) from exc
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.name, 0o700, dir_fd=root_fd)
            try:
                fd = os.open(path.name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=root_fd)
            except OSError as exc:
                raise ShmDirError(
                    f"{path} is not a directory of this daemon's ({exc.strerror})", path=str(path)
                ) from exc
        except OSError as exc:
            raise ShmDirError(f"cannot create {path}: {exc.strerror}", path=str(path)) from exc
        finally:
            os.close(root_fd)
        try:
            claim(fd, path, gid, NOT_OURS)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, gid)

    def create(self, name: str, nbytes: int) -> tuple[int, mmap.mmap]:
        """A new arena file ``name`` of ``nbytes``, locked and mapped read-write; returns its
        descriptor (held for the arena's life: the lock says a live daemon owns it)."""
        staging = f".{name}"
        fd = os.open(
            staging,
            os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            self.file_mode,
            dir_fd=self.fd,
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
            os.fchmod(fd, self.file_mode)  # whatever the umask
            os.ftruncate(fd, nbytes)
            try:  # reserve the pages now: a full tmpfs must fail here, not SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise InsufficientMemoryError(
                    f"cannot reserve {nbytes} bytes in {self.path}: {exc.strerror}",
                    needed=nbytes,
                ) from exc
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # link, unlike rename, never replaces an existing name: the creation is exclusive.
            os.link(staging, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.unlink(staging, dir_fd=self.fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging, dir_fd=self.fd)
            raise
        return fd, mapping

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def remove_stale(self) -> list[Path]:
        """Delete arena files (finished or half-created) of dead daemons of this user."""
        return _remove_stale(self.fd, self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmFile:
    """A daemon-owned shared-memory file, mapped read-write."""

    def __init__(self, directory: ArenaDir, boot_id: str, label: str, nbytes: int) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:80]
        self.name = f"{FILE_PREFIX}{boot_id}-{safe}-{secrets.token_hex(4)}"
        self.directory = directory
        self.path = directory.path / self.name
        self.nbytes = nbytes
        self._fd, mapping = directory.create(self.name, nbytes)
        self.tensor = byte_tensor(mapping)
        del mapping  # the tensor holds the mapping; it is unmapped with the last view

    @classmethod
    def adopt(cls, directory: ArenaDir, name: str, fd: int, nbytes: int) -> ShmFile:
        """The arena file ``name`` of an earlier daemon, from a descriptor of it the keeper held
        (the same open file, so the same lock): still at its path, regular and of its size, or
        ``ValueError`` saying what changed. The descriptor becomes this file's."""
        st = os.fstat(fd)
        try:
            now = os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
        except OSError as exc:
            raise ValueError(f"{directory.path / name} is gone ({exc.strerror})") from exc
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{directory.path / name} was replaced by another file")
        if st.st_size != nbytes:
            raise ValueError(f"{directory.path / name} holds {st.st_size} bytes, not {nbytes}")
        self = cls.__new__(cls)
        self.name, self.directory, self.path, self.nbytes = (
            name,
            directory,
            directory.path / name,
            nbytes,
        )
        self._fd = fd
        self.tensor = byte_tensor(
            mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        )
        return self

    @property
    def fd(self) -> int:
        """The descriptor held for the arena's life (its lock says a live daemon or keeper owns
        the file); passed to engines and to the keeper, which share the lock through it."""
        return self._fd

    def open_read_only(self) -> int:
        """A new read-only descriptor of this file (``OSError`` if its name no longer names it)."""
        return self._open(os.O_RDONLY)

    def open_read_write(self) -> int:
        """A new read-write descriptor of this file, for the donor that writes it (``OSError``
        if its name no longer names it)."""
        return self._open(os.O_RDWR)

    def _open(self, access: int) -> int:
        fd = os.open(
            self.name,
            access | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            dir_fd=self.directory.fd,
        )
        held, opened = os.fstat(self._fd), os.fstat(fd)
        if (held.st_dev, held.st_ino) != (opened.st_dev, opened.st_ino):
            os.close(fd)
            raise OSError(f"{self.path} no longer names the arena's file")
        return fd

    def close(self) -> None:
        """Unlink and drop the mapping (unmapped once no view of it is left); engines that
        mapped the file keep their pages until they unmap."""
        del self.tensor
        self.directory.unlink(self.name)
        os.close(self._fd)

    def detach(self) -> None:
        """Drop this process's mapping and descriptor, leaving the file to the keeper."""
        del self.tensor
        os.close(self._fd)


def _remove_one(dir_fd: int, name: str, seen: os.stat_result) -> bool:
    """Unlink ``name`` if it is still the regular file ``seen``, ours, and nobody holds its
    lock. Opened non-blocking and without following links: a FIFO or symlink is never
    waited on or followed."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino) or not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # a live daemon holds it
            raise
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_stale(dir_fd: int, directory: Path) -> list[Path]:
    uid = os.geteuid()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(dir_fd))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith((FILE_PREFIX, _STAGING_PREFIX)):
            continue
        try:
            seen = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (
            stat.S_ISREG(seen.st_mode)
            and seen.st_uid == uid
            and _remove_one(dir_fd, entry.name, seen)
        ):
            removed.append(directory / entry.name)
    return removed


def remove_if_held(path: Path, fd: int) -> bool:
    """Unlink ``path`` if it still names the file open as ``fd`` (not a file put in its place):
    an arena file let go of by whoever held it last."""
    try:
        held, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (held.st_dev, held.st_ino) != (named.st_dev, named.st_ino):
            return False
        path.unlink()
    except OSError:
        return False
    return True


def remove_stale_files(directory: Path) -> list[Path]:
    """Delete arena files of dead daemons of this user directly in ``directory`` (an arena
    directory, or a shared-memory root where earlier versions kept them)."""
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError:
        return []
    try:
        return _remove_stale(fd, Path(directory))
    finally:
        os.close(fd)

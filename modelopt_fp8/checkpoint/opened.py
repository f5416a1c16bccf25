"""Checkpoint files opened once and then used only through their descriptors.

A path is checked, then opened, then read: between those steps anyone who can write below an
allowed root could swap a file for a symlink to somewhere else, or for a FIFO that blocks the
reader forever. So a checkpoint is opened file by file, relative to its opened directory,
non-blocking (a FIFO opens at once and is refused), without following a last symlink where the
policy forbids them; the allowed-root check looks at what was opened (its real path through
``/proc/self/fd``); and every later read is an ``os.pread`` on that descriptor. Reads release the
GIL and share no file offset, so several threads may read one file at once.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    CorruptFileError,
    InvalidConfigError,
    NotRegularFileError,
    PathNotAllowedError,
    PathTooLongError,
    PermissionDeniedError,
    SymlinkRefusedError,
    WeightCacheError,
)

# Bounds what a hostile file can cost before it is judged (configs and indexes are kilobytes).
MAX_JSON_BYTES = 16 * 1024 * 1024
# Far more than any real checkpoint's safetensors files (a few dozen): each is a descriptor held
# while a load runs. A directory's listing stops past it; an index may name no more.
MAX_WEIGHT_FILES = 1024
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class PathPolicy:
    """Where checkpoints may be read from. ``roots`` None: anywhere (checkpoints named on the
    daemon's command line, or by an engine for itself); otherwise every opened file's real path
    must lie below one of them (give them resolved). ``follow_symlinks`` False refuses a
    checkpoint directory or file that is itself a symlink."""

    roots: tuple[Path, ...] | None = None
    follow_symlinks: bool = True

    @classmethod
    def below(cls, roots: list[Path], follow_symlinks: bool = True) -> PathPolicy:
        return cls(tuple(Path(os.path.realpath(r)) for r in roots), follow_symlinks)

    def allows(self, real: str | Path) -> bool:
        if self.roots is None:
            return True
        path = Path(real)
        return any(path == root or path.is_relative_to(root) for root in self.roots)

    @property
    def flags(self) -> int:
        return _OPEN_FLAGS | (0 if self.follow_symlinks else os.O_NOFOLLOW)


def fd_real_path(fd: int) -> str:
    """What an open descriptor refers to, as the kernel names it (symlinks resolved)."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _outside(policy: PathPolicy, path: Path) -> bool:
    """For paths that could not be opened: whether they would lie outside the roots (so a
    refusal never says whether something outside exists)."""
    if policy.roots is None:
        return False
    try:
        return not policy.allows(os.path.realpath(path))
    except (OSError, ValueError):
        return True


def os_refusal(exc: OSError, where: Path, policy: PathPolicy) -> WeightCacheError:
    """A typed refusal for an ``OSError`` met opening ``where`` (never a 500)."""
    if exc.errno == errno.ELOOP:
        loop = policy.follow_symlinks
        return SymlinkRefusedError(
            "symlink loop" if loop else "symlinks are not allowed by this daemon's path policy",
            file=str(where),
            reason="symlink_loop" if loop else "symlink_not_allowed",
        )
    if exc.errno == errno.ENAMETOOLONG:
        return PathTooLongError("path or one of its components is too long", file=str(where))
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return CheckpointNotFoundError("does not exist or is not a directory", file=str(where))
    if exc.errno == errno.ENXIO:  # a socket, or a device without a driver
        return NotRegularFileError("not a regular file", file=str(where))
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDeniedError(
            f"the daemon (uid {os.getuid()}) may not read this file", file=str(where)
        )
    return CheckpointUnreadableError(
        f"cannot open: {exc.strerror or type(exc).__name__}", file=str(where)
    )


@dataclass(frozen=True)
class ReadFile:
    """A small file (a config, the shard index) as it was read whole, and its ``fstat`` then:
    what the identity tiers hash, so they never open the name again."""

    data: bytes
    stat: os.stat_result


class OpenedFile:
    """One regular file, opened once; read with :meth:`pread`/:meth:`readinto` only."""

    def __init__(self, fd: int, path: Path, size: int, st: os.stat_result | None = None) -> None:
        self.fd = fd
        self.path = path  # as named in the checkpoint (for messages), not its symlink target
        self.size = size
        self.stat = st if st is not None else os.fstat(fd)
        self.read: ReadFile | None = None  # set by read_all

    @property
    def name(self) -> str:
        return self.path.name

    def readinto(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` (a writable byte view) from ``offset``; short files are refused."""
        view = buffer.cast("B") if buffer.format != "B" else buffer
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CorruptFileError(
                    f"read failed: {exc.strerror or exc}", file=str(self.path)
                ) from exc
            if n == 0:
                raise CorruptFileError(
                    f"file ended at {offset + done} bytes while reading (truncated while open?)",
                    file=str(self.path),
                )
            done += n

    def pread(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.readinto(offset, memoryview(buffer))
        return bytes(buffer)

    def read_all(self, limit: int = MAX_JSON_BYTES) -> bytes:
        if self.size > limit:
            raise InvalidConfigError(
                f"{self.size} bytes is more than the {limit}-byte limit for this file",
                file=str(self.path),
            )
        data = self.pread(0, self.size)
        self.read = ReadFile(data, self.stat)
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def parse_json_object(data: bytes, file: OpenedFile | Path) -> dict[str, Any]:
    """A JSON object from a config or index file; anything else is ``invalid_config``."""
    path = file.path if isinstance(file, OpenedFile) else file
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidConfigError(f"cannot parse {path.name}: {reason}", file=str(path)) from exc
    if not isinstance(value, dict):
        raise InvalidConfigError(f"{path.name} is not a JSON object", file=str(path))
    return value


class CheckpointDir:
    """An opened checkpoint directory; files are opened relative to it, never by full path."""

    def __init__(self, fd: int, path: Path, real: Path, policy: PathPolicy) -> None:
        self.fd = fd
        self.path = path
        self.real = real
        self.policy = policy
        self._opened: list[OpenedFile] = []

    def read_files(self) -> dict[str, ReadFile]:
        """Every file of this directory that was read whole (configs, the index), by name."""
        return {f.name: f.read for f in self._opened if f.read is not None}

    @classmethod
    def open(cls, path: str | Path, policy: PathPolicy | None = None) -> CheckpointDir:
        policy = policy or PathPolicy()
        path = Path(path)
        try:
            fd = os.open(path, policy.flags | os.O_DIRECTORY)
        except OSError as exc:
            if _outside(policy, path):
                raise PathNotAllowedError(
                    "the path is outside the allowed roots", path=str(path)
                ) from exc
            raise os_refusal(exc, path, policy) from exc
        try:
            real = Path(fd_real_path(fd))
        except OSError as exc:
            os.close(fd)
            raise CheckpointUnreadableError(
                "cannot tell what the directory is (no /proc?)", file=str(path)
            ) from exc
        if not policy.allows(real):
            os.close(fd)
            raise PathNotAllowedError("the path is outside the allowed roots", path=str(path))
        return cls(fd, path, real, policy)

    def open_file(self, name: str) -> OpenedFile | None:
        """Open ``name`` in this directory; None if it does not exist, a typed refusal if it is
        not a plain file name, not a regular file, or lies outside the allowed roots."""
        where = self.path / name
        if not name or "/" in name or "\0" in name or name in (".", ".."):
            raise InvalidConfigError("not a plain file name in the checkpoint", file=repr(name))
        try:
            fd = os.open(name, self.policy.flags, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise os_refusal(exc, where, self.policy) from exc
        try:
            if self.policy.roots is not None:  # first: say nothing of what lies outside
                try:
                    real = fd_real_path(fd)
                except OSError as exc:
                    raise CheckpointUnreadableError(
                        "cannot tell what the file is", file=str(where)
                    ) from exc
                if not self.policy.allows(real):
                    raise PathNotAllowedError(
                        f"{name} is outside the allowed roots", path=str(where)
                    )
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFileError(
                    "not a regular file (a FIFO, device, socket or directory)", file=str(where)
                )
        except BaseException:
            os.close(fd)
            raise
        opened = OpenedFile(fd, where, st.st_size, st)
        self._opened.append(opened)
        return opened

    def require_file(self, name: str, error: type[CheckpointError], detail: str) -> OpenedFile:
        opened = self.open_file(name)
        if opened is None:
            raise error(detail, file=str(self.path / name))
        return opened

    def names(self, suffix: str) -> list[str]:
        """Visible entries ending in ``suffix``, sorted (at most :data:`MAX_WEIGHT_FILES`: the
        listing stops past it)."""
        found: list[str] = []
        try:
            with os.scandir(self.fd) as entries:
                for entry in entries:
                    if entry.name.endswith(suffix) and not entry.name.startswith("."):
                        found.append(entry.name)
                        if len(found) > MAX_WEIGHT_FILES:
                            raise InvalidConfigError(
                                f"the checkpoint holds {len(found)} {suffix} files or more "
                                f"(at most {MAX_WEIGHT_FILES})",
                                file=str(self.path),
                            )
        except OSError as exc:
            raise CheckpointUnreadableError(
                f"cannot list the directory: {exc.strerror}", file=str(self.path)
            ) from exc
        return sorted(found)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

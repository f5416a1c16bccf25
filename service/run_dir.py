"""The run directory: where the daemon's handle socket and the keeper's socket live.

In containers it is ``/run/weight-cache``, a volume the daemon, the keeper and the engines
share; elsewhere ``$XDG_RUNTIME_DIR/weight-cache``, else ``/run/weight-cache`` for root, else
``/tmp/weight-cache-u<uid>``. It is the daemon's user's, never a link, mode 0700 (0750 and
group-owned with ``--shm-group``, whose members may then connect): a neighbour can neither plant
a socket in it nor reach one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from pathlib import Path

from protocol.errors import ShmDirError
from service.private_dir import claim

HANDLE_SOCKET = "handles.sock"
KEEPER_SOCKET = "keeper.sock"
KEEPER_LOG = "keeper.log"


def default_run_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "weight-cache"
    if os.geteuid() == 0:
        return Path("/run/weight-cache")
    return Path(f"/tmp/weight-cache-u{os.geteuid()}")


NOT_OURS = (
    "the run directory {path} belongs to uid {owner}, not to this user ({uid}): chown it or "
    "choose another --run-dir"
)


def prepare_run_dir(path: Path, gid: int | None = None) -> None:
    """Create (or take over) ``path``: ours, a directory, not a link, mode 0700 (0750 with a
    group). Raises :class:`~protocol.errors.ShmDirError` when it is someone else's."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmDirError(
            f"the run directory {path} is not a directory of this user's ({exc.strerror})",
            path=str(path),
        ) from exc
    try:
        claim(fd, path, gid, NOT_OURS)
    finally:
        os.close(fd)


def answers(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def listen_unix(path: Path, gid: int | None = None) -> socket.socket:
    """A listening socket at ``path`` (mode 0600, 0660 with a group), replacing a socket file
    nobody answers on; one that answers means another process serves there (``OSError``
    EADDRINUSE)."""
    if path.is_symlink() or (path.exists() and not stat.S_ISSOCK(path.lstat().st_mode)):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    if path.exists():
        if answers(path):
            raise OSError(errno.EADDRINUSE, f"another process serves on {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, 0o660 if gid is not None else 0o600)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock

"""The daemon's Unix socket: whoever may open the file may use the API without a token.

It is created 0600 (the daemon's user only), or 0660 owned by ``--socket-group``, and never
wider, not even between ``bind`` and ``chmod`` (the umask is narrowed around ``bind``, as uvicorn's
own 0666 would open it to every local user). It is removed at shutdown if it is still the file
this daemon made (same inode), so a later daemon's socket is never taken away.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

from protocol.errors import ShmDirError
from service.memory.shm import group_id

GROUP_TOO = 0o660


def socket_group_id(group: str) -> int:
    """The gid of ``--socket-group`` (a name or a number); ``ValueError`` naming it when
    unknown (a bad setting)."""
    try:
        gid = group_id(group)
    except ShmDirError:
        raise ValueError(f"--socket-group {group}: no such group on this host") from None
    assert gid is not None
    return gid


class PrivateSocket:
    """A listening Unix socket at ``path``, 0600 or (with ``group``) 0660 owned by that group,
    which removes its file when done if the file is still its own."""

    def __init__(self, path: Path, group: str | None = None, backlog: int = 2048) -> None:
        gid = socket_group_id(group) if group is not None else None
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the file is born 0600: no moment when others could connect
        try:
            self.sock.bind(str(path))
        except OSError:
            self.sock.close()
            raise
        finally:
            os.umask(old)
        try:
            if gid is not None:
                os.chown(path, -1, gid)
                os.chmod(path, GROUP_TOO)
            made = path.lstat()
            self._identity = (made.st_dev, made.st_ino)
            self.sock.listen(backlog)
        except OSError:
            self.sock.close()
            path.unlink(missing_ok=True)
            raise

    def remove(self) -> None:
        """Remove the socket file, unless another file took its name meanwhile."""
        with contextlib.suppress(OSError):
            found = self.path.lstat()
            if stat.S_ISSOCK(found.st_mode) and (found.st_dev, found.st_ino) == self._identity:
                self.path.unlink()

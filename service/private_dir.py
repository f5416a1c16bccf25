"""A directory only this daemon's user may use (its group too, if one is named): the arena
directory and the run directory are both made so, on a descriptor already opened without
following links."""

from __future__ import annotations

import os
from pathlib import Path

from protocol.errors import ShmDirError


def claim(fd: int, path: Path, gid: int | None, not_ours: str) -> None:
    """Refuse the directory open at ``fd`` unless this user owns it (``not_ours``: the
    refusal, with ``{path}``, ``{owner}`` and ``{uid}``, ours), then give it ``gid`` and mode
    0700 (0750 with a group)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        refusal = not_ours.format(path=path, owner=st.st_uid, uid=os.geteuid())
        raise ShmDirError(refusal, path=str(path))
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o750 if gid is not None else 0o700)
    except OSError as exc:
        raise ShmDirError(
            f"cannot set the owner group or mode of {path}: {exc.strerror}", path=str(path)
        ) from exc

"""Bearer tokens kept in files (a compose secret, a mounted file): read the same way by the daemon
and by every client."""

from __future__ import annotations

from pathlib import Path

from service.errors import UnauthorizedError


def read_token_file(path: str | Path) -> str:
    """The token in ``path``, surrounding whitespace stripped; a missing, unreadable or empty
    file is an :class:`UnauthorizedError` naming it."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UnauthorizedError(f"cannot read token file {path}: {exc.strerror}") from exc
    if not token:
        raise UnauthorizedError(f"token file {path} is empty")
    return token

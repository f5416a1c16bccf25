"""Bearer tokens kept in files (a compose secret, a mounted file): read the same way by the daemon
and by every client, under one precedence rule."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from protocol.errors import UnauthorizedError


def read_token_file(path: str | Path) -> str:
    """The token in ``path``, surrounding whitespace stripped; a missing, unreadable or empty
    file is an :class:`UnauthorizedError` naming it (and, when unreadable, what to do)."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except PermissionError as exc:
        raise UnauthorizedError(
            f"cannot read token file {path}: {exc.strerror} (this process runs as uid "
            f"{os.getuid()}, gid {os.getgid()}; make the file readable by them, e.g. "
            f"`chgrp {os.getgid()} {path} && chmod 0640 {path}`)"
        ) from exc
    except OSError as exc:
        raise UnauthorizedError(f"cannot read token file {path}: {exc.strerror}") from exc
    if not token:
        raise UnauthorizedError(f"token file {path} is empty")
    return token


def resolve_token(
    token: str | None = None,
    token_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The one rule, for daemon and clients alike: what is given (flag, option) wins over the
    environment, and within each a token file wins over a token value."""
    if token_file:
        return read_token_file(token_file)
    if token:
        return token
    environ = os.environ if environ is None else environ
    if environ.get("WEIGHT_CACHE_TOKEN_FILE"):
        return read_token_file(environ["WEIGHT_CACHE_TOKEN_FILE"])
    return environ.get("WEIGHT_CACHE_TOKEN") or None

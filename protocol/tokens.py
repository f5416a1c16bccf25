"""Bearer tokens, from a flag, an option, the environment or a file (a compose secret, a mounted
file): chosen by the daemon and by every client under one precedence rule, and read one way."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from protocol.client_settings import TOKEN, TOKEN_FILE
from protocol.errors import UnauthorizedError
from protocol.setting import setting_of


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (:func:`clean_token`); a missing, unreadable or empty file is an
    :class:`UnauthorizedError` naming it (and, when unreadable, what to do)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except PermissionError as exc:
        raise UnauthorizedError(
            f"cannot read token file {path}: {exc.strerror} (this process runs as uid "
            f"{os.getuid()}, gid {os.getgid()}; make the file readable by them, e.g. "
            f"`chgrp {os.getgid()} {path} && chmod 0640 {path}`)"
        ) from exc
    except OSError as exc:
        raise UnauthorizedError(f"cannot read token file {path}: {exc.strerror}") from exc
    return clean_token(text, f"the token in {path}", f"token file {path} is empty")


def clean_token(value: str, what: str = "the token", empty: str | None = None) -> str:
    """``value`` as daemon and clients compare it: surrounding whitespace stripped, refused
    (:class:`UnauthorizedError`) when nothing is left (``empty`` says so) or when an HTTP
    header cannot carry it (:func:`header_safe`)."""
    token = value.strip()
    if not token:
        raise UnauthorizedError(empty or f"{what} is empty or whitespace only")
    return header_safe(token, what)


def header_safe(token: str, what: str = "the token") -> str:
    """``token`` if an HTTP header can carry it as it is (visible ASCII, no spaces), else an
    :class:`UnauthorizedError` saying so (rather than a ``UnicodeEncodeError`` from the first
    request that sends it)."""
    bad = next((c for c in token if not 0x21 <= ord(c) <= 0x7E), None)
    if bad is not None:
        raise UnauthorizedError(
            f"{what} holds {bad!r} (U+{ord(bad):04X}): a bearer token must be visible ASCII "
            "without spaces, e.g. `openssl rand -hex 32`"
        )
    return token


def untrusted_token_file(path: str | Path) -> str | None:
    """Why a daemon must not take its token from ``path``, or ``None`` when it may: the file
    must be its own user's or root's (another owner knows the token and may change it) and
    private to its owner and group (not readable or writable by every user)."""
    st = os.stat(path)
    if st.st_uid not in (os.geteuid(), 0):
        return (
            f"token file {path} belongs to uid {st.st_uid}, neither this user (uid "
            f"{os.geteuid()}) nor root: that user knows the token and may change it; "
            f"`chown {os.geteuid()} {path}`, or write a token file of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        return (
            f"token file {path} is {'readable' if mode & stat.S_IROTH else 'writable'} by every "
            f"user (mode {mode:04o}): `chmod o-rwx {path}` (0600, or 0640 for a group; a "
            "Kubernetes secret volume: defaultMode 0440)"
        )
    return None


TOKEN_VARIABLE = setting_of(TOKEN).variable
TOKEN_FILE_VARIABLE = setting_of(TOKEN_FILE).variable


def choose_token(
    token: str | None = None,
    token_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[str | None, str | Path | None]:
    """The one rule, for daemon and clients alike, without reading any file: what is given (a
    flag, a loader option, a keyword) wins over the environment, and within each a token file
    wins over a token value. Returns ``(value, None)``, ``(None, file)`` or ``(None, None)``."""
    if token_file:
        return None, token_file
    if token:
        return token, None
    environ = os.environ if environ is None else environ
    if environ.get(TOKEN_FILE_VARIABLE):
        return None, environ[TOKEN_FILE_VARIABLE]
    return environ.get(TOKEN_VARIABLE) or None, None


def resolve_token(
    token: str | None = None,
    token_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The token :func:`choose_token` picks, read from its file when it is one."""
    value, file = choose_token(token, token_file, environ)
    if file:
        return read_token_file(file)
    return clean_token(value) if value else None

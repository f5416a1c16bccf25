"""The front's numbers: from the daemon's settings, and the ones that are not settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import SecretStr

MAX_PIPELINED = 32  # requests a connection may have in the daemon's hands at once
KEEP_ALIVE_S = 5  # idle keep-alive connections close after this (uvicorn's option)
PROBE_ROOM = 16  # connections past the cap, for /health and /ready alone
PROBE_PATHS = frozenset({"/health", "/ready"})  # never counted against a caller, never refused
PARSE_PIECE = 4096  # bytes given to the parser at once: a refusal stops it within a piece
LINGER_S = 1.0  # a refused request's remaining bytes are read (and dropped) this long at most
LINGER_BYTES = 256 << 10  # ... and this many: then the connection is reset


def _no_token() -> SecretStr | None:
    return None


def _uncounted(code: str) -> None:
    return None


@dataclass(frozen=True)
class FrontLimits:
    max_connections: int
    max_header_bytes: int
    request_timeout_s: float
    requests_per_caller: int
    token: Callable[[], SecretStr | None] = _no_token  # the daemon's, as it is now
    on_refuse: Callable[[str], None] = _uncounted  # counts a refusal under its code

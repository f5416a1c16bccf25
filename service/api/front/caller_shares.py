"""Requests in the daemon's hands, per caller, so that no caller holds every connection.

A request is in the daemon's hands from its headers until its answer is complete: long-polls
and bodies still arriving included. The caller is what the front can tell before any route runs:
the token's holders (one caller, whoever they are), else the user the kernel says is at the
other end (``SO_PEERCRED`` on the Unix socket, the socket's owner on loopback TCP; unknown, for
a remote peer, is one caller too). Each has ``requests_per_caller`` at once, a quarter of the
connections by default; ``/health`` and ``/ready`` never count.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import SecretStr

from service.api.auth import bearer_matches
from service.api.peer import ConnectionPeer


@dataclass(frozen=True)
class CallerKey:
    token: bool  # showed the daemon's token: the token's holders are one caller
    uid: int | None  # else the user (None: not known)

    def __str__(self) -> str:
        if self.token:
            return "the token's holders"
        return "an unknown user" if self.uid is None else f"uid {self.uid}"


TOKEN_HOLDERS = CallerKey(token=True, uid=None)


def caller_key(
    headers: list[tuple[bytes, bytes]],
    token: SecretStr | None,
    peer: ConnectionPeer,
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
) -> CallerKey:
    """Who asks, as far as the front can tell without blocking (a TCP peer's uid is the
    kernel's ``sock_diag`` answer, found once per connection)."""
    if token is not None:
        header = next((v for k, v in headers if k == b"authorization"), None)
        if header is not None and bearer_matches(header.decode("latin-1"), token):
            return TOKEN_HOLDERS
    if not peer.resolve_quickly(client, server):
        return CallerKey(token=False, uid=None)
    return CallerKey(token=False, uid=peer.credentials(client, server).uid)


class CallerShares:
    def __init__(self, per_caller: int) -> None:
        self.per_caller = per_caller
        self._held: dict[CallerKey, int] = {}

    def take(self, caller: CallerKey) -> bool:
        """One more request of ``caller`` in hand, if it has room; whether it had."""
        held = self._held.get(caller, 0)
        if held >= self.per_caller:
            return False
        self._held[caller] = held + 1
        return True

    def give_back(self, caller: CallerKey) -> None:
        held = self._held.get(caller, 0) - 1
        if held > 0:
            self._held[caller] = held
        else:
            self._held.pop(caller, None)

    def held(self, caller: CallerKey) -> int:
        return self._held.get(caller, 0)

"""Who may call the API, decided before a route reads a byte of the body.

An ASGI middleware in front of every route but ``/health`` and ``/ready``, so a caller without
the right token is answered 401 before bad JSON could be 422:

- With a token (``--token-file`` / ``WEIGHT_CACHE_TOKEN``): ``Authorization: Bearer <token>``,
  compared in constant time; a token in the query string is never looked at. A token holder is
  trusted with every lease.
- Without a token, local trust: a Unix-socket peer was let in by the socket's mode (0600, or
  0660 with ``--socket-group``); a loopback TCP peer must be the daemon's own user or root
  (``peer_not_allowed`` otherwise), unless ``--trust-local-users``.

The caller (its uid and pid as the kernel proved them, and whether it showed the token) goes to
the routes in ``scope[CALLER_KEY]``: leases are tied to it (:mod:`service.registry.lease_holders`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from protocol.errors import PeerNotAllowedError, UnauthorizedError
from service.api.peer import PEER_KEY, ConnectionPeer, PeerCredentials
from service.api.problems import refuse
from service.registry.lease_holders import Caller

OPEN_PATHS = frozenset({"/health", "/ready"})
CALLER_KEY = "weight_cache.caller"


def bearer_matches(header: str, token: SecretStr) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (constant time)."""
    scheme, _, presented = header.partition(" ")
    expected = token.get_secret_value().encode()
    given = presented.strip().encode("latin-1", "replace")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, expected)


def _is_ip(address: Any) -> bool:
    if not (isinstance(address, tuple | list) and address):
        return False
    try:
        ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    except ValueError:
        return False
    return True


async def peer_of(scope: Scope) -> PeerCredentials:
    """The request's peer as the kernel says: the connection's, found once per connection
    (the guarded front puts it in the scope); through no socket at all (an in-process client),
    this process itself."""
    client, server = scope.get("client"), scope.get("server")
    peer = scope.get(PEER_KEY)
    if peer is None:
        if not _is_ip(client):
            return PeerCredentials(uid=os.geteuid(), pid=os.getpid(), via="local")
        peer = ConnectionPeer(None)
    assert isinstance(peer, ConnectionPeer)
    if peer.resolve_quickly(client, server):
        return peer.credentials(client, server)
    # The kernel's netlink answer is not to be had here: /proc/net/tcp is read, off the loop.
    return await anyio.to_thread.run_sync(peer.credentials, client, server)


class Authenticate:
    """ASGI middleware: the token, or local trust, before any route runs."""

    def __init__(
        self,
        app: ASGIApp,
        token: Callable[[], SecretStr | None],
        trust_local_users: bool,
        on_refuse: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.token = token
        self.trust_local_users = trust_local_users
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = self.token()
        showed_token = False
        if token is not None:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not bearer_matches(header.decode("latin-1"), token):
                unauthorized = UnauthorizedError("send 'Authorization: Bearer <token>'")
                await refuse(scope, receive, send, unauthorized, self.on_refuse)
                return
            showed_token = True
        peer = await peer_of(scope)
        caller = Caller(uid=peer.uid, pid=peer.pid, token=showed_token, via=peer.via)
        if not caller.trusted and not self.trust_local_users and caller.via == "tcp":
            who = "an unknown user" if peer.uid is None else f"uid {peer.uid}"
            error = PeerNotAllowedError(
                f"without a token this daemon serves only its own user (uid {os.geteuid()}) "
                f"and root over TCP; this request comes from {who}",
                uid=peer.uid,
            )
            await refuse(scope, receive, send, error, self.on_refuse)
            return
        scope[CALLER_KEY] = caller
        await self.app(scope, receive, send)

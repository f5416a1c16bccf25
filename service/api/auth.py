"""Bearer-token auth, compared in constant time. Only the ``Authorization`` header counts:
a token in the query string is never looked at."""

from __future__ import annotations

import hmac

from fastapi import Request

from protocol.errors import UnauthorizedError


async def require_token(request: Request) -> None:
    token = request.app.state.daemon.token
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    expected = token.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), expected):
        raise UnauthorizedError("send 'Authorization: Bearer <token>'")

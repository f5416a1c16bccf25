"""A request-body size limit, enforced before a handler reads the body; the limit is chosen
per request (a donation's body lists every tensor of a rank, from a caller allowed to donate)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.errors import PayloadTooLargeError
from service.api.auth import CALLER_KEY
from service.api.problems import refuse
from service.registry.donations import may_donate
from service.registry.lease_holders import Caller
from service.settings import DaemonSettings


def body_limits(settings: DaemonSettings, donations_prefix: str) -> Callable[[Scope], int]:
    """Each request's limit: ``max_donation_body_bytes`` on the donation routes for a caller
    allowed to donate (``Authenticate``, which runs first, put the caller in the scope), else
    ``max_body_bytes``: anyone else is refused before sending a donation-sized body."""

    def limit(scope: Scope) -> int:
        caller = scope.get(CALLER_KEY)
        if (
            str(scope.get("path", "")).startswith(donations_prefix)
            and isinstance(caller, Caller)
            and may_donate(caller, settings.allow_token_donations)
        ):
            return int(settings.max_donation_body_bytes)
        return int(settings.max_body_bytes)

    return limit


class BodySizeLimit:
    """ASGI middleware answering 413 when a body exceeds ``max_bytes(scope)`` (declared or
    streamed)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: Callable[[Scope], int],
        on_refuse: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refuse = on_refuse

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        error = PayloadTooLargeError(f"request body exceeds {limit} bytes", limit=limit)
        await refuse(scope, receive, send, error, self.on_refuse)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes(scope)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = limit + 1
                if declared > limit:
                    await self._refuse(scope, receive, send, limit)
                    return
        seen = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit and not refused:
                    # Answer now, and tell the app the client went away so it stops reading.
                    refused = True
                    await self._refuse(scope, receive, send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:  # once refused, the app's own answer is dropped
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

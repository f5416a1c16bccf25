"""A request-body size limit, enforced before a handler reads the body."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.errors import PayloadTooLargeError
from service.api.problems import refuse


class BodySizeLimit:
    """ASGI middleware answering 413 when a body exceeds ``max_bytes`` (declared or streamed)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_refuse: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refuse = on_refuse

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = PayloadTooLargeError(
            f"request body exceeds {self.max_bytes} bytes", limit=self.max_bytes
        )
        await refuse(scope, receive, send, error, self.on_refuse)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = self.max_bytes + 1
                if declared > self.max_bytes:
                    await self._refuse(scope, receive, send)
                    return
        seen = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not refused:
                    # Answer now, and tell the app the client went away so it stops reading.
                    refused = True
                    await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:  # once refused, the app's own answer is dropped
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

"""The HTTP front: uvicorn, with bounds a hostile client cannot push past.

uvicorn alone accepts every connection, waits forever for a request's headers, and lets one
header grow without limit; its own ``limit_concurrency`` answers only once headers are complete.
The protocol here (uvicorn's httptools protocol with a guard around it) refuses a connection
beyond ``max_connections`` as soon as it is accepted, closes a request whose line and headers
exceed ``max_header_bytes``, and one not received in full within ``request_timeout_s`` (headers
and body, from its first byte or from the connection's start). Each refusal is a problem document
with its code, and is counted in ``weight_cache_refusals``.
"""

from __future__ import annotations

import asyncio
import http
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from protocol.errors import (
    HeadersTooLargeError,
    MalformedRequestError,
    RequestTimeoutError,
    TooManyConnectionsError,
    WeightCacheError,
)
from service.api.problems import PROBLEM_MEDIA_TYPE
from service.logsafe import get_logger
from service.settings import DaemonSettings

log = get_logger(__name__)


@dataclass(frozen=True)
class FrontLimits:
    max_connections: int
    max_header_bytes: int
    request_timeout_s: float
    on_refuse: Callable[[str], None] | None = None


def problem_bytes(error: WeightCacheError) -> bytes:
    """A complete HTTP/1.1 response carrying ``error``, closing the connection."""
    body = json.dumps(error.problem_fields()).encode()
    head = (
        f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n"
        f"content-type: {PROBLEM_MEDIA_TYPE}\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def guarded_protocol(limits: FrontLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol class, bounded by ``limits``."""

    too_many = problem_bytes(
        TooManyConnectionsError(
            f"the daemon serves at most {limits.max_connections} connections",
            limit=limits.max_connections,
        )
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _in_headers = True
        _header_bytes = 0
        _turned_away = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                # Turned away before any per-connection state exists: a flood costs little.
                self._turned_away = True
                if limits.on_refuse is not None:
                    limits.on_refuse(TooManyConnectionsError.code)
                transport.write(too_many)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._turned_away:
                return
            self._disarm()
            super().connection_lost(exc)

        # --- the request-read deadline ---------------------------------------------------------

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(limits.request_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and cycle.response_started:
                self.transport.close()  # answering already; a problem now would garble it
                return
            self._refuse(
                RequestTimeoutError(
                    f"the request was not received within {limits.request_timeout_s} s",
                    limit_s=limits.request_timeout_s,
                )
            )

        def _refuse(self, error: WeightCacheError) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            if limits.on_refuse is not None:
                limits.on_refuse(error.code)
            self.transport.write(problem_bytes(error))
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """The parser's refusal of bytes that are not HTTP, as a problem document."""
            self._refuse(MalformedRequestError(f"malformed HTTP request: {msg}"))

        def _too_large(self) -> None:
            self._refuse(
                HeadersTooLargeError(
                    f"request line and headers exceed {limits.max_header_bytes} bytes",
                    limit=limits.max_header_bytes,
                )
            )

        # --- parser events ---------------------------------------------------------------------

        def data_received(self, data: bytes) -> None:
            if self._turned_away or self.transport.is_closing():
                return
            super().data_received(data)
            if self._in_headers and not self.transport.is_closing():
                # All of this chunk is (at most) header bytes the parser is still holding.
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._too_large()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_bytes = 0
            self._arm()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > limits.max_header_bytes:
                self._too_large()
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self.transport.is_closing() or self.cycle is None:
                return
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            if self.transport.is_closing() or self.cycle is None:
                return
            super().on_message_complete()

    return GuardedHttpToolsProtocol


def server_config(app: FastAPI, settings: DaemonSettings, **extra: Any) -> uvicorn.Config:
    """uvicorn's configuration for the daemon's app behind the guarded protocol."""
    daemon = getattr(app.state, "daemon", None)
    on_refuse = daemon.count_refusal if daemon else None
    limits = FrontLimits(
        max_connections=settings.max_connections,
        max_header_bytes=settings.max_header_bytes,
        request_timeout_s=settings.request_timeout_s,
        on_refuse=on_refuse,
    )
    where: dict[str, Any] = (
        {"uds": str(settings.uds)}
        if settings.uds
        else {"host": settings.host, "port": settings.port}
    )
    options: dict[str, Any] = {"log_level": "info", "access_log": False, **where, **extra}
    return uvicorn.Config(app, http=guarded_protocol(limits), timeout_keep_alive=5, **options)

"""The HTTP front: uvicorn, with bounds a hostile client cannot push past.

uvicorn's public options bound what they can: idle keep-alive connections close after
``timeout_keep_alive``, a shutdown waits at most ``timeout_graceful_shutdown`` for connections,
the listen backlog is ``backlog``, and there is no access log. What they cannot bound is bounded
by a subclass of uvicorn's httptools protocol (its internal ``HttpToolsProtocol``: uvicorn's
``limit_concurrency`` answers only once a request's headers are in, and httptools has no size
limit at all). This module is the one place that touches uvicorn's internals; it was written
against uvicorn ``UVICORN_VERSION`` and ``tests/service/api/test_front_pin.py`` fails on any
other version. The bounds:

- **connections**: at most ``max_connections``. At the cap, an idle connection (no request in
  the daemon's hands) makes way for the new one, as nginx reuses idle keep-alive connections
  when it runs out: first the oldest that has not yet finished a request (it sent nothing, or
  part of a request), then the oldest keep-alive one between requests. A client that has been
  answered is the last to lose its connection, because closing one between requests can race a
  request it is sending (it sees a disconnect and no answer), while a connection that never
  finished a request loses nothing. When none is idle the new connection is answered 503 at
  once, before any per-connection state exists.
- **framing bytes**: a request's line, headers, chunk headers and trailers, everything but its
  body, at most ``max_header_bytes`` (431), counted as they arrive, so a trailer of gigabytes
  costs no more than a header of them.
- **time**: a request must arrive whole within ``request_timeout_s`` of its first byte (408); an
  answer the client does not read must drain within ``request_timeout_s`` once the socket backs
  up, else the connection is aborted (a reader that never reads holds nothing for long).
- **pipelining**: at most ``MAX_PIPELINED`` requests ahead of their answers; past that the
  connection is closed (answers must go out in order, so there is no refusal to send).

Each refusal is counted in ``weight_cache_refusals_total`` under its code. A Unix-socket peer's
credentials (``SO_PEERCRED``) are read once per connection and given to every request in
``scope[PEER_KEY]`` (:class:`service.api.peer.ConnectionPeer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http
import json
import logging
import socket
import struct
import termios
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
from protocol.logsafe import get_logger
from service.api.peer import PEER_KEY, ConnectionPeer, unix_credentials
from service.api.problems import PROBLEM_MEDIA_TYPE
from service.settings import DaemonSettings

log = get_logger(__name__)

UVICORN_VERSION = "0.55.0"  # the uvicorn whose HttpToolsProtocol this module subclasses
MAX_PIPELINED = 32  # requests a connection may have in the daemon's hands at once
CHUNK_FRAMING_BYTES = 24  # a chunk's size line and CRLFs, beside max_header_bytes
KEEP_ALIVE_S = 5  # idle keep-alive connections close after this (uvicorn's option)
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset
_INT = struct.Struct("i")


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

    too_many = TooManyConnectionsError(
        f"the daemon serves at most {limits.max_connections} connections and all of them have "
        "a request in progress",
        limit=limits.max_connections,
    )
    # Connections with no request in the daemon's hands, the longest idle first in each: those
    # that have not finished a request yet, and keep-alive ones between requests.
    unproven: dict[GuardedHttpToolsProtocol, None] = {}
    between: dict[GuardedHttpToolsProtocol, None] = {}

    def count(code: str) -> None:
        if limits.on_refuse is not None:
            limits.on_refuse(code)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None  # the request must arrive by then
        _stall: asyncio.TimerHandle | None = None  # the answer must drain by then
        _framing = 0  # bytes of the current request that are not its body
        _chunks = 0  # chunk headers of the current request
        _current: Any = None  # the current request's cycle, once its headers are in
        _turned_away = False
        peer: ConnectionPeer | None = None

        # --- connections -----------------------------------------------------------------------

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections and not self._make_way():
                # Turned away before any per-connection state exists: a flood costs little.
                self._turned_away = True
                count(TooManyConnectionsError.code)
                transport.write(problem_bytes(too_many))
                transport.close()
                return
            self.peer = ConnectionPeer(unix_credentials(transport.get_extra_info("socket")))
            super().connection_made(transport)
            unproven[self] = None
            self._arm()

        @staticmethod
        def _make_way() -> bool:
            """Close an idle connection, if any, for a new one: the oldest that has not finished
            a request, else the oldest between requests."""
            victim = next(iter(unproven), None)
            if victim is None:
                victim = next(iter(between), None)
            if victim is None:
                return False
            victim._not_idle()
            if victim._framing:  # part of a request came: say why it ends
                victim._refuse(too_many)
            else:
                victim._close_now()
            return True

        def connection_lost(self, exc: Exception | None) -> None:
            if self._turned_away:
                return
            self._not_idle()
            self._disarm()
            self._unstall()
            super().connection_lost(exc)

        def _not_idle(self) -> None:
            unproven.pop(self, None)
            between.pop(self, None)

        def _close_now(self) -> None:
            """Close, dropping what the client has not read (a close would wait for it)."""
            if self.transport.get_write_buffer_size():
                self._reset()
            else:
                self.transport.close()

        def _reset(self) -> None:
            """Abort with a reset: neither the transport nor the kernel keeps unread bytes for
            a client that does not read (a plain close leaves them queued in an orphan)."""
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            self.transport.abort()

        def _close_after_drain(self) -> None:
            """Close once what was written is read, giving the client the request timeout to
            read it (a plain close would wait for a client that never reads)."""
            if self.transport.get_write_buffer_size() and self._stall is None:
                self._stall = self.loop.call_later(limits.request_timeout_s, self._stalled)
            self.transport.close()

        def _refuse(self, error: WeightCacheError) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            count(error.code)
            self.transport.write(problem_bytes(error))
            self._close_after_drain()

        def timeout_keep_alive_handler(self) -> None:
            """An idle keep-alive connection ends (uvicorn's option). One whose client has not
            read its last answer in all that time is reset: a close would leave the answer
            queued in the kernel for a reader that never comes."""
            if self.transport.is_closing():
                return
            if self._unsent():
                count(RequestTimeoutError.code)
                log.info("resetting an idle connection whose client left its answer unread")
                self._reset()
            else:
                self.transport.close()

        def _unsent(self) -> int:
            """Bytes written and not yet read by the client: in the transport and the kernel."""
            queued = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, _INT.pack(0))
                    queued += _INT.unpack(raw)[0]
            return queued

        # --- the request deadline --------------------------------------------------------------

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(limits.request_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            cycle = self._current
            if cycle is not None and cycle.response_started:
                count(RequestTimeoutError.code)  # answered or answering: no problem to add
                self._close_now()
                return
            self._refuse(
                RequestTimeoutError(
                    f"the request was not received within {limits.request_timeout_s} s",
                    limit_s=limits.request_timeout_s,
                )
            )

        # --- the answer's drain deadline -------------------------------------------------------

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall is None:
                self._stall = self.loop.call_later(limits.request_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            self._unstall()
            super().resume_writing()

        def _unstall(self) -> None:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _stalled(self) -> None:
            self._stall = None
            log.info(
                "closing a connection whose client read none of its answer for %s s",
                limits.request_timeout_s,
            )
            count(RequestTimeoutError.code)
            self._reset()

        # --- bytes and parser events -----------------------------------------------------------

        def send_400_response(self, msg: str) -> None:
            """The parser's refusal of bytes that are not HTTP, as a problem document."""
            self._refuse(MalformedRequestError(f"malformed HTTP request: {msg}"))

        def _too_large(self) -> None:
            self._refuse(
                HeadersTooLargeError(
                    f"request line, headers and trailers exceed {limits.max_header_bytes} bytes",
                    limit=limits.max_header_bytes,
                )
            )

        def data_received(self, data: bytes) -> None:
            if self._turned_away or self.transport.is_closing():
                return
            self._framing += len(data)  # the body's share is taken off as the parser finds it
            self._arm()
            super().data_received(data)
            budget = limits.max_header_bytes + CHUNK_FRAMING_BYTES * self._chunks
            if self._framing > budget and not self.transport.is_closing():
                self._too_large()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._current = None
            self.scope[PEER_KEY] = self.peer  # type: ignore[literal-required]
            self._arm()

        def on_headers_complete(self) -> None:
            if self.transport.is_closing():
                return  # refused earlier in this read: nothing more reaches the daemon
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > limits.max_header_bytes:
                self._too_large()
                return
            in_hand = len(self.pipeline) + (
                self.cycle is not None and not self.cycle.response_complete
            )
            if in_hand >= MAX_PIPELINED:
                log.info("closing a connection with %d requests unanswered in a row", in_hand)
                count("too_many_pipelined")
                self._disarm()
                self._close_now()
                return
            super().on_headers_complete()
            self._current = self.cycle
            self._not_idle()

        def on_chunk_header(self) -> None:
            self._chunks += 1

        def on_body(self, body: bytes) -> None:
            self._framing = max(0, self._framing - len(body))
            if self.transport.is_closing() or self._current is None:
                return
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            self._framing = self._chunks = 0
            if self.transport.is_closing() or self._current is None:
                return
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                between.pop(self, None)
                between[self] = None  # idle since now: the last to make way

    return GuardedHttpToolsProtocol


def check_uvicorn_version() -> None:
    """Say so when uvicorn is not the version the guarded protocol was written against."""
    if uvicorn.__version__ != UVICORN_VERSION:
        logging.getLogger(__name__).warning(
            "uvicorn %s is installed; the HTTP front's bounds were written against uvicorn %s "
            "(install that version: pip install 'uvicorn[standard]==%s')",
            uvicorn.__version__,
            UVICORN_VERSION,
            UVICORN_VERSION,
        )


def server_config(app: FastAPI, settings: DaemonSettings, **extra: Any) -> uvicorn.Config:
    """uvicorn's configuration for the daemon's app behind the guarded protocol."""
    check_uvicorn_version()
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
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        timeout_keep_alive=KEEP_ALIVE_S,
        # Connections still open at shutdown are given the request timeout to finish.
        timeout_graceful_shutdown=max(1, round(settings.request_timeout_s)),
        **options,
    )

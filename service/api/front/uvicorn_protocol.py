"""uvicorn's httptools protocol, bounded: the one module that touches uvicorn's internals.

uvicorn's ``limit_concurrency`` answers only once a request's headers are in, and httptools has
no size limit at all, so the front subclasses uvicorn's internal ``HttpToolsProtocol``, written
against uvicorn ``UVICORN_VERSION`` (``tests/service/api/test_front_pin.py`` fails on any other
and names what it relies on). Each connection asks the parts of :mod:`service.api.front`:

- **connecting**: at the cap an idle connection makes way, or the newcomer is let in for
  ``/health`` and ``/ready`` alone, or it is turned away 503 before any state of its own
  exists (``admission``);
- **bytes**: given to the parser ``PARSE_PIECE`` at a time and counted (``framing``): past a
  bound the request is refused (431, 400 ``chunks_too_small``) within the piece that passed it;
- **headers in**: at most ``MAX_PIPELINED`` requests ahead of their answers (past that the
  connection is closed: answers go out in order); the caller's share of requests in hand
  (``caller_shares``; 429 past it);
- **time** (``deadline``): the whole request within ``request_timeout_s`` of its first byte
  (408); an answer the client does not read drains within as long, else a reset;
- **an answer before the whole request came** (the front's refusals, and the app's 401, 403,
  413): nothing more of it is parsed; its remaining bytes are read and dropped for at most
  ``LINGER_S`` and ``LINGER_BYTES`` (a client still sending reads its answer rather than a
  reset), then the connection closes.

Each refusal is counted under its code. A Unix-socket peer's credentials are read once per
connection and given to every request in ``scope[PEER_KEY]``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from protocol.errors import (
    MalformedRequestError,
    RequestTimeoutError,
    TooManyConnectionsError,
    TooManyOpenRequestsError,
    WeightCacheError,
)
from protocol.logsafe import get_logger
from service.api.front.admission import Admission, Admitted, Idleness
from service.api.front.answers import problem_bytes
from service.api.front.caller_shares import CallerKey, CallerShares, caller_key
from service.api.front.deadline import Deadline
from service.api.front.framing import FramingBudget
from service.api.front.limits import (
    LINGER_BYTES,
    LINGER_S,
    MAX_PIPELINED,
    PARSE_PIECE,
    PROBE_PATHS,
    FrontLimits,
)
from service.api.front.transport_ends import reset, unsent, waiting
from service.api.peer import PEER_KEY, ConnectionPeer, unix_credentials

log = get_logger(__name__)

UVICORN_VERSION = "0.55.0"  # the uvicorn whose HttpToolsProtocol this module subclasses
_PROBE_PATHS = frozenset(path.encode() for path in PROBE_PATHS)


@dataclass
class Front:
    """What the connections of one server share: its limits, who is idle, and how many
    requests each caller has in hand."""

    limits: FrontLimits
    admission: Admission[GuardedHttpToolsProtocol] = field(init=False)
    shares: CallerShares = field(init=False)
    too_many: TooManyConnectionsError = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.limits.max_connections)
        self.shares = CallerShares(self.limits.requests_per_caller)
        self.too_many = TooManyConnectionsError(
            f"the daemon serves at most {self.limits.max_connections} connections and all of "
            "them have a request in progress",
            limit=self.limits.max_connections,
        )


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection. The server's :class:`Front` is a class attribute: uvicorn makes each
    connection's protocol from the class alone (:func:`protocol_for`)."""

    front: ClassVar[Front]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limits = self.front.limits
        self.framing = FramingBudget(limits.max_header_bytes)
        # The request must arrive whole by then; the answer must drain by then; the bytes of a
        # request answered early are read (and dropped) until then.
        self.request_deadline = Deadline(self.loop, limits.request_timeout_s, self._timed_out)
        self.drain_deadline = Deadline(self.loop, limits.request_timeout_s, self._stalled)
        self.linger_deadline = Deadline(self.loop, LINGER_S, self._close_after_drain)
        self.in_hand: deque[CallerKey | None] = deque()  # per request in hand: its caller
        self.peer: ConnectionPeer | None = None
        self._current: Any = None  # the current request's cycle, once its headers are in
        self._turned_away = False
        self._probes_only = False
        self._dropped: int | None = None  # bytes dropped while lingering (None: not lingering)

    # --- connections -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        admitted = self.front.admission.admit(self, len(self.connections))
        if admitted is None:
            # Turned away before any per-connection state exists: a flood costs little.
            self._turned_away = True
            self.front.limits.on_refuse(TooManyConnectionsError.code)
            transport.write(problem_bytes(self.front.too_many))
            transport.close()
            return
        self._probes_only = admitted is Admitted.PROBES_ONLY
        self.peer = ConnectionPeer(unix_credentials(transport.get_extra_info("socket")))
        super().connection_made(transport)
        self.front.admission.idle(self, Idleness.UNPROVEN)
        self.request_deadline.arm()

    def make_way(self) -> None:
        """Close for a newcomer: this connection was idle."""
        if self.framing.started and self._dropped is None:  # part of a request came: say why
            self.front.limits.on_refuse(TooManyConnectionsError.code)
            self.transport.write(problem_bytes(self.front.too_many))
            self._close_after_drain()
        else:
            self._close_now()

    def has_waiting_bytes(self) -> bool:
        return waiting(self.transport) > 0

    def connection_lost(self, exc: Exception | None) -> None:
        if self._turned_away:
            return
        self.front.admission.forget(self)
        for deadline in (self.request_deadline, self.drain_deadline, self.linger_deadline):
            deadline.disarm()
        while self.in_hand:
            self._give_back(self.in_hand.popleft())
        super().connection_lost(exc)

    def _give_back(self, caller: CallerKey | None) -> None:
        if caller is not None:  # None: a probe, never counted
            self.front.shares.give_back(caller)

    def _close_now(self) -> None:
        """Close, dropping what the client has not read (a close would wait for it)."""
        if self.transport.get_write_buffer_size():
            reset(self.transport)
        else:
            self.transport.close()

    def _close_after_drain(self) -> None:
        """Close once what was written is read, giving the client the request timeout to
        read it (a plain close would wait for a client that never reads)."""
        if self.transport.get_write_buffer_size():
            self.drain_deadline.arm()
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        """An idle keep-alive connection ends (uvicorn's option). One whose client has not
        read its last answer in all that time is reset: a close would leave the answer
        queued in the kernel for a reader that never comes."""
        if self.transport.is_closing():
            return
        if unsent(self.transport):
            self.front.limits.on_refuse(RequestTimeoutError.code)
            log.info("resetting an idle connection whose client left its answer unread")
            reset(self.transport)
        else:
            self.transport.close()

    # --- ending a request early ----------------------------------------------------------------

    def _refuse(self, error: WeightCacheError) -> None:
        """The front answers ``error`` in place of the app and ends the request."""
        self.request_deadline.disarm()
        if self.transport.is_closing() or self._dropped is not None:
            return
        self.front.limits.on_refuse(error.code)
        cycle = self._current
        if cycle is not None and cycle.response_started:
            self._close_after_drain()  # an answer is on its way: no problem to add to it
            return
        self._stop_app()
        self.transport.write(problem_bytes(error))
        self._linger()

    def _stop_app(self) -> None:
        """The app is told the client left (its reads end, its answer is dropped), and the
        requests pipelined behind never start."""
        cycle = self._current
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self._current = None
        self.pipeline.clear()

    def _linger(self) -> None:
        """Parse nothing more: say so to the client (end of our side once the answer is
        written), read and drop what it still sends for a bounded time and number of bytes,
        then close. A client still sending reads its answer rather than a reset."""
        self._dropped = 0
        self.request_deadline.disarm()
        self._unset_keepalive_if_required()
        self.front.admission.idle(self, Idleness.LINGERING)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self.transport.get_write_buffer_size():
            self.drain_deadline.arm()
        self.linger_deadline.arm()

    def _drop(self, nbytes: int) -> None:
        assert self._dropped is not None
        self._dropped += nbytes
        if self._dropped > LINGER_BYTES:
            self._close_now()

    # --- deadlines: the request's, the answer's drain ------------------------------------------

    def _timed_out(self) -> None:
        cycle = self._current
        if cycle is not None and cycle.response_started:
            self.front.limits.on_refuse(RequestTimeoutError.code)  # no problem to add to it
            self._close_now()
            return
        limit = self.front.limits.request_timeout_s
        self._refuse(
            RequestTimeoutError(f"the request was not received within {limit} s", limit_s=limit)
        )

    def pause_writing(self) -> None:
        super().pause_writing()
        self.drain_deadline.arm()

    def resume_writing(self) -> None:
        self.drain_deadline.disarm()
        super().resume_writing()

    def _stalled(self) -> None:
        log.info(
            "closing a connection whose client read none of its answer for %s s",
            self.front.limits.request_timeout_s,
        )
        self.front.limits.on_refuse(RequestTimeoutError.code)
        reset(self.transport)

    # --- bytes and parser events ---------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """The parser's refusal of bytes that are not HTTP, as a problem document."""
        self._refuse(MalformedRequestError(f"malformed HTTP request: {msg}"))

    def data_received(self, data: bytes) -> None:
        if self._turned_away or self.transport.is_closing():
            return
        if self._dropped is not None:
            self._drop(len(data))
            return
        self.request_deadline.arm()
        view = memoryview(data)
        for start in range(0, len(data), PARSE_PIECE):
            piece = view[start : start + PARSE_PIECE]
            self.framing.arrived(len(piece))
            super().data_received(piece)  # type: ignore[arg-type]
            if self.transport.is_closing():
                return
            if self._dropped is None and (refusal := self.framing.passed()) is not None:
                self._refuse(refusal)
            if self._dropped is not None:  # refused, or answered, within this piece
                self._drop(len(data) - start - len(piece))
                return
            if self.parser.should_upgrade():
                return  # what follows an upgrade is not HTTP, and the daemon speaks no other

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._current = None
        self.scope[PEER_KEY] = self.peer  # type: ignore[literal-required]
        self.request_deadline.arm()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.framing.line()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.transport.is_closing() or self._dropped is not None:
            return  # refused earlier in this piece: nothing more reaches the daemon
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        refusal = self.framing.passed()
        if refusal is None and size > self.front.limits.max_header_bytes:
            refusal = self.framing.too_large()
        if refusal is not None:
            self._refuse(refusal)
            return
        in_hand = len(self.pipeline) + (self.cycle is not None and not self.cycle.response_complete)
        if in_hand >= MAX_PIPELINED:
            log.info("closing a connection with %d requests unanswered in a row", in_hand)
            self.front.limits.on_refuse("too_many_pipelined")
            self.request_deadline.disarm()
            self._close_now()
            return
        admitted, caller = self._admit_request()
        if not admitted:
            return
        super().on_headers_complete()
        if caller is not None:
            self.front.shares.take(caller)
        self.in_hand.append(caller)
        self._current = self.cycle
        self.front.admission.busy(self)

    def _admit_request(self) -> tuple[bool, CallerKey | None]:
        """Whether the request goes on to the app, and whom it counts against (None: a probe,
        which never counts). One refused (a probe-only connection asking for more, a caller
        at its share) is answered here."""
        try:
            path = httptools.parse_url(self.url).path
        except httptools.HttpParserInvalidURLError:
            path = b""  # uvicorn's own parse refuses it next
        if path in _PROBE_PATHS:
            return True, None
        if self._probes_only:
            self._refuse(self.front.too_many)
            return False, None
        assert self.peer is not None
        server = cast("tuple[str, int] | None", self.server)  # a port for TCP, none on a socket
        caller = caller_key(self.headers, self.front.limits.token(), self.peer, self.client, server)
        shares = self.front.shares
        if shares.held(caller) >= shares.per_caller:
            self._refuse(
                TooManyOpenRequestsError(
                    f"{caller} has {shares.per_caller} requests in progress already (long-polls "
                    "and requests still arriving included)",
                    limit=shares.per_caller,
                )
            )
            return False, None
        return True, caller

    def on_chunk_header(self) -> None:
        self.framing.chunk()

    def on_body(self, body: bytes) -> None:
        self.framing.body(len(body))
        if self.transport.is_closing() or self._current is None or self._dropped is not None:
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self.request_deadline.disarm()
        refusal = self.framing.passed()  # its trailers may have passed a bound in this piece
        self.framing.begin()
        if refusal is not None:
            self._refuse(refusal)
        if self.transport.is_closing() or self._current is None or self._dropped is not None:
            return
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self.in_hand:
            self._give_back(self.in_hand.popleft())
        # Answered before the whole request came (401, 403, 413): the rest is not parsed.
        early = not self.pipeline and self._current is self.cycle and self.cycle.more_body
        super().on_response_complete()
        if self.transport.is_closing() or self._dropped is not None:
            return
        if early:
            self._current = None
            self._linger()
        elif not self.pipeline:
            self.front.admission.idle(self, Idleness.BETWEEN)  # idle since now: the last to go


def protocol_for(front: Front) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn makes each connection of one server from."""
    return cast(
        "type[GuardedHttpToolsProtocol]",
        type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"front": front}),
    )


def check_uvicorn_version() -> None:
    """Say so when uvicorn is not the version the guarded protocol was written against."""
    if uvicorn.__version__ != UVICORN_VERSION:
        log.warning(
            "uvicorn %s is installed; the HTTP front's bounds were written against uvicorn %s "
            "(install that version: pip install 'uvicorn[standard]==%s')",
            uvicorn.__version__,
            UVICORN_VERSION,
            UVICORN_VERSION,
        )

"""The handle socket (``<run_dir>/handles.sock``): passes an arena's descriptor by
``SCM_RIGHTS`` to the holder of a live lease on it (or to the donor of a pending donation, which
writes it), and a typed refusal to anyone else.

It runs beside the API in threads of its own, never on the event loop: one reads every
connection's request as its bytes come, waiting on none (a selector), and a few workers answer
the requests that came whole (they look the lease up under the daemon's lock and read
``/proc``). The whole exchange is bounded, so that a peer trickling bytes holds no thread and
no slot for long, and a lease holder is answered meanwhile:

- a request (one message of at most ``MAX_REQUEST_BYTES``, no descriptors) must come whole
  within ``REQUEST_S`` of the connection, else it is refused (``handle_refused``, why
  ``timeout``) and the connection closed;
- at most ``MAX_CONNECTIONS`` connections at once, and ``PER_PEER`` of one user's (the
  kernel's ``SO_PEERCRED``): past those a connection is refused at once (why ``busy``), so one
  member of the socket's group cannot take the others' room;
- the answer is sent within ``ANSWER_S``, and the connection closed.

A refused or malformed request changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import HandleRefusedError, WeightCacheError
from protocol.fd_passing import (
    MAX_FDS,
    FramingError,
    decode_message,
    framed_payload,
    peer_credentials,
    send_message,
)
from protocol.handle_socket import MAX_REQUEST_BYTES, HandleAnswer, HandleRequest
from protocol.logsafe import get_logger
from service.registry.handle_access import Claim, Peer, holder_refusal
from service.registry.lease_holders import trusted_uids
from service.run_dir import listen_unix

log = get_logger(__name__)

# (lease id, arena index) -> (the lease or pending donation, a descriptor of the arena, its size).
Lookup = Callable[[str, int], tuple[Claim, int, int]]
MAX_CONNECTIONS = 256
PER_PEER = 16  # connections of one user at once
REQUEST_S = 2.0  # a request must come whole within this of its connection
ANSWER_S = 2.0  # the answer must be taken within this
WORKERS = 4  # threads answering requests that came whole
_IDLE_WAIT_S = 0.5  # the reader looks whether it was stopped at least this often


@dataclass
class _Arriving:
    """A connection whose request is still coming."""

    conn: socket.socket
    peer: Peer
    deadline: float
    data: bytearray = field(default_factory=bytearray)


class HandleServer:
    def __init__(
        self,
        path: Path,
        lookup: Lookup,
        on_refusal: Callable[[str], None] = lambda code: None,
        gid: int | None = None,
    ) -> None:
        self.path = path
        self.lookup = lookup
        self.on_refusal = on_refusal
        self.gid = gid
        self.uids = trusted_uids()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._workers: ThreadPoolExecutor | None = None
        self._slots = threading.Lock()  # guards the two counts below
        self._open = 0
        self._per_uid: Counter[int] = Counter()

    def start(self) -> None:
        self._listener = listen_unix(self.path, self.gid)
        self._listener.setblocking(False)
        self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="handle-answer")
        self._thread = threading.Thread(target=self._read, name="handle-socket", daemon=True)
        self._thread.start()
        log.info("passing arena descriptors to lease holders on %s", self.path)

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._thread is not None:
            self._thread.join(5)
        if listener is not None:
            listener.close()
        if self._workers is not None:
            self._workers.shutdown(wait=True, cancel_futures=True)

    # --- reading requests, one thread for all --------------------------------------------------

    def _read(self) -> None:
        listener = self._listener
        assert listener is not None
        arriving: dict[socket.socket, _Arriving] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            try:
                while self._listener is not None:
                    now = time.monotonic()
                    first = min((a.deadline for a in arriving.values()), default=now + 1)
                    wait = max(0.0, min(first - now, _IDLE_WAIT_S))
                    for key, _ in selector.select(wait):
                        if key.fileobj is listener:
                            self._accept(listener, selector, arriving)
                        else:
                            self._receive(arriving[key.fileobj], selector, arriving)  # type: ignore[index]
                    self._expire(selector, arriving)
            finally:
                for arrival in arriving.values():
                    self._close(arrival.conn, arrival.peer)

    def _accept(
        self,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        arriving: dict[socket.socket, _Arriving],
    ) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed by stop()
            pid, uid, gid = peer_credentials(conn)
            peer = Peer(pid, uid, gid)
            why = self._take_slot(uid)
            if why is not None:
                self._refuse_now(conn, HandleRefusedError(why, why="busy"))
                conn.close()
                continue
            conn.setblocking(False)
            arriving[conn] = _Arriving(conn, peer, time.monotonic() + REQUEST_S)
            selector.register(conn, selectors.EVENT_READ)

    def _take_slot(self, uid: int) -> str | None:
        """Count one more connection of ``uid``; why not, when it is past a bound."""
        with self._slots:
            if self._open >= MAX_CONNECTIONS:
                return f"the handle socket has {MAX_CONNECTIONS} connections open"
            if self._per_uid[uid] >= PER_PEER:
                return f"uid {uid} has {PER_PEER} connections open to the handle socket"
            self._open += 1
            self._per_uid[uid] += 1
        return None

    def _close(self, conn: socket.socket, peer: Peer) -> None:
        conn.close()
        with self._slots:
            self._open -= 1
            self._per_uid[peer.uid] -= 1
            if self._per_uid[peer.uid] <= 0:
                del self._per_uid[peer.uid]

    def _receive(
        self,
        arrival: _Arriving,
        selector: selectors.BaseSelector,
        arriving: dict[socket.socket, _Arriving],
    ) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(arrival.conn, MAX_REQUEST_BYTES + 8, MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        for fd in fds:
            os.close(fd)
        try:
            if fds:
                raise FramingError("descriptors sent with a request")
            if not data:
                if arrival.data:
                    raise FramingError("the peer closed the connection inside a message")
                self._done_reading(arrival, selector, arriving)
                self._close(arrival.conn, arrival.peer)
                return
            arrival.data += data
            payload = framed_payload(arrival.data, MAX_REQUEST_BYTES)
        except FramingError as exc:
            self._done_reading(arrival, selector, arriving)
            self._refuse_now(arrival.conn, _malformed(exc))
            self._close(arrival.conn, arrival.peer)
            return
        if payload is not None:
            self._done_reading(arrival, selector, arriving)
            assert self._workers is not None
            self._workers.submit(self._answer, arrival.conn, arrival.peer, payload)

    @staticmethod
    def _done_reading(
        arrival: _Arriving,
        selector: selectors.BaseSelector,
        arriving: dict[socket.socket, _Arriving],
    ) -> None:
        selector.unregister(arrival.conn)
        del arriving[arrival.conn]

    def _expire(
        self, selector: selectors.BaseSelector, arriving: dict[socket.socket, _Arriving]
    ) -> None:
        now = time.monotonic()
        for arrival in [a for a in arriving.values() if a.deadline <= now]:
            self._done_reading(arrival, selector, arriving)
            error = HandleRefusedError(
                f"the request did not come whole within {REQUEST_S} s", why="timeout"
            )
            self._refuse_now(arrival.conn, error)
            self._close(arrival.conn, arrival.peer)

    def _refuse_now(self, conn: socket.socket, error: HandleRefusedError) -> None:
        """Refuse without waiting on the peer (its socket takes the few bytes, or nothing)."""
        conn.setblocking(False)
        self._refuse(conn, error)

    def _refuse(self, conn: socket.socket, error: HandleRefusedError) -> None:
        """Log, count and answer a refusal (an answer the peer does not take is dropped)."""
        log.warning("handle socket: %s", error.detail)
        self.on_refusal(error.code)
        with contextlib.suppress(OSError):
            send_message(conn, HandleAnswer(ok=False, problem=error.problem_fields()))

    # --- answering, in the workers -------------------------------------------------------------

    def _answer(self, conn: socket.socket, peer: Peer, payload: bytes) -> None:
        fd = -1
        try:
            conn.settimeout(ANSWER_S)  # blocking again, within ANSWER_S per call
            try:
                request = decode_message(HandleRequest, payload)
            except FramingError as exc:
                raise _malformed(exc) from None
            try:
                lease, fd, size = self.lookup(request.lease, request.arena)
            except WeightCacheError as exc:
                raise HandleRefusedError(
                    f"no descriptor for lease {request.lease}: {exc.detail}", why=exc.code
                ) from exc
            why = holder_refusal(lease, request.secret, peer, self.uids)
            if why is not None:
                raise HandleRefusedError(
                    f"refused lease {request.lease} to pid {peer.pid} uid {peer.uid}: {why}",
                    why=why,
                )
            send_message(conn, HandleAnswer(ok=True, size=size), [fd])
        except HandleRefusedError as exc:
            self._refuse(conn, exc)
        except OSError as exc:
            log.info("handle socket: an answer failed: %s", exc)
        finally:
            if fd >= 0:
                os.close(fd)
            self._close(conn, peer)


def _malformed(exc: FramingError) -> HandleRefusedError:
    return HandleRefusedError(f"not a handle request: {exc}", why="malformed")

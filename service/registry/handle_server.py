"""The handle socket (``<run_dir>/handles.sock``): passes an arena's descriptor by
``SCM_RIGHTS`` to the holder of a live lease on it, and a typed refusal to anyone else.

It runs beside the API in threads of its own (one per connection, a bounded number at once),
never on the event loop. Every connection is answered within its timeout and closed; a refused
or malformed request changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from protocol.errors import HandleRefusedError, WeightCacheError
from protocol.fd_passing import FramingError, peer_credentials, receive_message, send_message
from protocol.handle_socket import MAX_REQUEST_BYTES, HandleAnswer, HandleRequest
from protocol.logsafe import get_logger
from service.registry.handle_access import Peer, holder_refusal
from service.registry.lease_holders import trusted_uids
from service.registry.leases import Lease
from service.run_dir import listen_unix

log = get_logger(__name__)

# (lease id, arena index) -> (the lease, a duplicate of the arena's descriptor, its size).
Lookup = Callable[[str, int], tuple[Lease, int, int]]
MAX_CONNECTIONS = 64
TIMEOUT_S = 5.0


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
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._listener = listen_unix(self.path, self.gid)
        self._thread = threading.Thread(target=self._accept, name="handle-socket", daemon=True)
        self._thread.start()
        log.info("passing arena descriptors to lease holders on %s", self.path)

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._thread is not None:
            self._thread.join(5)

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many at once: the client sees the connection end
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(TIMEOUT_S)
            self._answer(conn)
            _drain(conn)
        except (OSError, FramingError) as exc:
            log.info("handle socket: a request failed: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        pid, uid, gid = peer_credentials(conn)
        peer = Peer(pid, uid, gid)
        fd = -1
        try:
            got = receive_message(conn, HandleRequest, MAX_REQUEST_BYTES)
            if got is None:
                return
            request = got[0]
            try:
                lease, fd, size = self.lookup(request.lease, request.arena)
            except WeightCacheError as exc:
                raise HandleRefusedError(
                    f"no descriptor for lease {request.lease}: {exc.detail}", why=exc.code
                ) from exc
            why = holder_refusal(lease, request.secret, peer, self.uids)
            if why is not None:
                raise HandleRefusedError(
                    f"refused lease {request.lease} to pid {pid} uid {uid}: {why}", why=why
                )
            send_message(conn, HandleAnswer(ok=True, size=size), [fd])
        except FramingError as exc:
            self._refuse(conn, HandleRefusedError(f"not a handle request: {exc}", why="malformed"))
        except HandleRefusedError as exc:
            self._refuse(conn, exc)
        finally:
            if fd >= 0:
                os.close(fd)

    def _refuse(self, conn: socket.socket, error: HandleRefusedError) -> None:
        log.warning("handle socket: %s", error.detail)
        self.on_refusal(error.code)
        with contextlib.suppress(OSError):
            send_message(conn, HandleAnswer(ok=False, problem=error.problem_fields()))


def _drain(conn: socket.socket, limit: int = 64 * 1024) -> None:
    """End our side, then read what the peer still sends (a bounded amount, briefly), so that
    closing does not reset the connection before the peer read the answer."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(0.5)
    while limit > 0:
        chunk = conn.recv(min(limit, 4096))
        if not chunk:
            return
        limit -= len(chunk)

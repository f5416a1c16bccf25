"""The keeper process (``weight-cache keeper``): holds every ready model's arena descriptors and
records, and the live leases, for whichever daemon attaches next.

It holds descriptors only: a CUDA allocation lives while any descriptor of it is open (no CUDA
context here, no torch), a shared-memory file while any descriptor of it is open (and the
file's lock with it, so a new daemon's start-up sweep leaves it alone). It serves one daemon at
a time; when that daemon's connection ends (a stop, a crash), it keeps everything and waits.
It lets go of an arena when the daemon drops the model (unloaded: no lease on it), and of
everything when it stops (SIGTERM) or after ``idle_timeout_s`` with no daemon attached.
Engines that still map an arena keep it alive themselves: the driver and the kernel count
their mappings.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path
from types import FrameType

from protocol.fd_passing import FramingError, peer_credentials
from protocol.logsafe import get_logger
from service.keeper.messages import (
    KEEPER_PROTOCOL,
    ArenaFd,
    Attach,
    DropLease,
    DropModel,
    PutLease,
    PutModel,
    Refused,
    Snapshot,
    Status,
    StatusReply,
)
from service.keeper.state import KeeperState
from service.keeper.wire import receive, send
from service.registry.lease_holders import trusted_uids
from service.run_dir import KEEPER_SOCKET, listen_unix, prepare_run_dir

log = get_logger(__name__)


class Keeper:
    def __init__(self, run_dir: Path, idle_timeout_s: float = 600.0, gid: int | None = None):
        self.run_dir = Path(run_dir)
        self.idle_timeout_s = idle_timeout_s
        self.gid = gid
        self.state = KeeperState()
        self.uids = trusted_uids()
        self.daemon_pid: int | None = None
        self.alone_since = time.monotonic()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None

    @property
    def socket_path(self) -> Path:
        return self.run_dir / KEEPER_SOCKET

    def serve(self) -> None:
        """Listen and serve until stopped (SIGTERM, SIGINT, or idle), then let go of all."""
        prepare_run_dir(self.run_dir, self.gid)
        self._listener = listen_unix(self.socket_path, self.gid)
        self._listener.settimeout(1.0)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("keeper %d holding arenas for daemons of %s", os.getpid(), self.run_dir)
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    self._check_idle()
                    continue
                except OSError:
                    break
                threading.Thread(target=self._connection, args=(conn,), daemon=True).start()
        finally:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            held = len(self.state.fds)
            self.state.clear(remove_files=self.daemon_pid is None)
            log.info("keeper stopped; let go of %d arena(s)", held)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def _check_idle(self) -> None:
        if self.daemon_pid is not None or self.idle_timeout_s <= 0:
            return
        if time.monotonic() - self.alone_since > self.idle_timeout_s:
            log.info("no daemon for %.0f s: stopping", self.idle_timeout_s)
            self._stop.set()

    def _connection(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = peer_credentials(conn)
            if uid not in self.uids:
                log.warning("refused a connection of uid %d (pid %d)", uid, pid)
                send(conn, Refused(detail=f"uid {uid} not allowed"))
                return
            got = receive(conn)
            if got is None:
                return
            message = got[0]
            if isinstance(message, Status):
                send(conn, self._status())
            elif isinstance(message, Attach):
                self._daemon(conn, message)
        except (OSError, FramingError) as exc:
            log.warning("keeper connection ended: %s", exc)
        finally:
            conn.close()

    def _status(self) -> StatusReply:
        with self.state.lock:
            return StatusReply(
                pid=os.getpid(),
                daemon_pid=self.daemon_pid,
                models=sorted(self.state.models),
                arenas=len(self.state.fds),
                leases=len(self.state.leases),
                idle_timeout_s=self.idle_timeout_s,
            )

    def _daemon(self, conn: socket.socket, attach: Attach) -> None:
        if attach.protocol != KEEPER_PROTOCOL:
            detail = (
                f"this keeper speaks protocol {KEEPER_PROTOCOL}, the daemon {attach.protocol}: "
                "stop the keeper (its models load again) and start the new version's"
            )
            send(conn, Refused(detail=detail))
            return
        with self.state.lock:
            if self.daemon_pid is not None:
                busy = self.daemon_pid
            else:
                busy, self.daemon_pid = None, attach.pid
        if busy is not None:
            detail = f"daemon pid {busy} holds this keeper"
            send(conn, Refused(detail=detail))
            return
        log.info("daemon pid %d (boot %s) attached", attach.pid, attach.boot_id)
        try:
            if attach.resync:
                self.state.clear()
            self._send_snapshot(conn)
            self._journal(conn)
        finally:
            with self.state.lock:
                self.daemon_pid = None
                self.alone_since = time.monotonic()
                held = len(self.state.fds)
            log.info("daemon pid %d detached; holding %d arena(s) for the next", attach.pid, held)

    def _send_snapshot(self, conn: socket.socket) -> None:
        with self.state.lock:
            models = list(self.state.models.values())
            leases = list(self.state.leases.values())
            fds = [
                (m.id, a.rank, os.dup(self.state.fds[(m.id, a.rank)]))
                for m in models
                for a in m.arenas
            ]
        try:
            send(conn, Snapshot(models=models, leases=leases))
            for model, rank, fd in fds:
                send(conn, ArenaFd(model=model, rank=rank), [fd])
        finally:
            for _, _, fd in fds:
                os.close(fd)

    def _journal(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        while True:
            got = receive(conn, max_fds=1)
            if got is None:
                return
            message, fds = got
            if isinstance(message, ArenaFd) and len(fds) == 1:
                self.state.put_fd((message.model, message.rank), fds[0])
                continue
            for fd in fds:
                os.close(fd)
            if isinstance(message, PutModel):
                self.state.put_model(message.model)
            elif isinstance(message, DropModel):
                self.state.drop_model(message.model)
            elif isinstance(message, PutLease):
                with self.state.lock:
                    self.state.leases[message.lease.id] = message.lease
            elif isinstance(message, DropLease):
                with self.state.lock:
                    self.state.leases.pop(message.lease, None)

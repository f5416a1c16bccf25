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

from protocol.fd_passing import FramingError, peer_credentials, receive_message, send_message
from protocol.logsafe import get_logger
from service.keeper.messages import (
    KEEPER_PROTOCOL,
    MAX_MESSAGE_BYTES,
    ArenaFd,
    Attach,
    DropLease,
    DropModel,
    Envelope,
    KeptLease,
    KeptModel,
    PutLease,
    PutModel,
    Refused,
    Snapshot,
    Status,
    StatusReply,
)
from service.memory.shm import remove_if_held
from service.registry.lease_holders import trusted_uids
from service.run_dir import KEEPER_SOCKET, listen_unix, prepare_run_dir

log = get_logger(__name__)
ArenaKey = tuple[str, int]  # (model id, rank)


class KeeperState:
    """What is held, under one lock: models, their arenas' descriptors, leases."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.models: dict[str, KeptModel] = {}
        self.fds: dict[ArenaKey, int] = {}
        self.pending: dict[ArenaKey, int] = {}  # received, their model not yet put
        self.leases: dict[str, KeptLease] = {}

    def put_fd(self, key: ArenaKey, fd: int) -> None:
        with self.lock:
            old = self.pending.pop(key, None)
            self.pending[key] = fd
        if old is not None:
            os.close(old)

    def put_model(self, model: KeptModel) -> None:
        with self.lock:
            stale = self._drop(model.id)
            taken = {r.rank: self.pending.pop((model.id, r.rank), None) for r in model.arenas}
            missing = [rank for rank, fd in taken.items() if fd is None]
            if not missing:
                self.models[model.id] = model
                self.fds.update({(model.id, r): fd for r, fd in taken.items() if fd is not None})
        for fd in stale + [fd for fd in taken.values() if fd is not None and missing]:
            os.close(fd)
        if missing:
            log.error(
                "model %s came without the descriptors of ranks %s: not kept", model.id, missing
            )

    def drop_model(self, model_id: str) -> None:
        with self.lock:
            stale = self._drop(model_id)
        for fd in stale:
            os.close(fd)

    def _drop(self, model_id: str) -> list[int]:
        self.models.pop(model_id, None)
        keys = [k for k in self.fds if k[0] == model_id]
        return [self.fds.pop(k) for k in keys]

    def clear(self, remove_files: bool = False) -> None:
        """Let go of everything; with ``remove_files`` (no daemon holds them), remove the
        shared-memory files too, as the daemon would on unload."""
        with self.lock:
            files = [
                (Path(a.shm_dir) / a.shm_name, self.fds.get((m.id, a.rank)))
                for m in self.models.values()
                for a in m.arenas
                if a.shm_dir and a.shm_name
            ]
            if remove_files:
                for path, fd in files:
                    if fd is not None:
                        remove_if_held(path, fd)
            fds = [*self.fds.values(), *self.pending.values()]
            self.models, self.fds, self.pending, self.leases = {}, {}, {}, {}
        for fd in fds:
            os.close(fd)


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
                send_message(conn, Envelope(message=Refused(detail=f"uid {uid} not allowed")))
                return
            got = receive_message(conn, Envelope, MAX_MESSAGE_BYTES)
            if got is None:
                return
            message = got[0].message
            if isinstance(message, Status):
                send_message(conn, Envelope(message=self._status()))
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
            send_message(conn, Envelope(message=Refused(detail=detail)))
            return
        with self.state.lock:
            if self.daemon_pid is not None:
                busy = self.daemon_pid
            else:
                busy, self.daemon_pid = None, attach.pid
        if busy is not None:
            detail = f"daemon pid {busy} holds this keeper"
            send_message(conn, Envelope(message=Refused(detail=detail)))
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
            send_message(conn, Envelope(message=Snapshot(models=models, leases=leases)))
            for model, rank, fd in fds:
                send_message(conn, Envelope(message=ArenaFd(model=model, rank=rank)), [fd])
        finally:
            for _, _, fd in fds:
                os.close(fd)

    def _journal(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        while True:
            got = receive_message(conn, Envelope, MAX_MESSAGE_BYTES, max_fds=1)
            if got is None:
                return
            envelope, fds = got
            message = envelope.message
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

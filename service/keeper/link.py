"""The daemon's side of the keeper: attach (starting a keeper with ``--keeper auto`` when none
answers), take what it held, then journal every change to it from one thread, in order.

A journal entry is queued under the daemon's lock (no I/O there) and sent by the journal
thread; grants never wait on the keeper. If the keeper goes away, the link attaches again (to a
new one) and sends everything the daemon holds instead of the entries it missed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from protocol.errors import KeeperUnavailableError
from protocol.fd_passing import FramingError, peer_credentials
from protocol.logsafe import get_logger
from protocol.schemas.inventory import KeeperMode
from service.keeper.messages import (
    ArenaFd,
    Attach,
    DropLease,
    DropModel,
    KeptLease,
    KeptModel,
    Message,
    PutLease,
    PutModel,
    Refused,
    Snapshot,
)
from service.keeper.wire import receive, send
from service.run_dir import KEEPER_LOG, KEEPER_SOCKET, answers

log = get_logger(__name__)

ArenaFds = dict[tuple[str, int], int]  # (model id, rank) -> descriptor
# Everything the daemon holds, for a keeper that missed entries: models with (duplicated)
# descriptors of their arenas, in rank order, and leases.
Holdings = Callable[[], tuple[list[tuple[KeptModel, list[int]]], list[KeptLease]]]
Entry = tuple[Message, list[int]]  # a message and the descriptors it carries (ours to close)


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _model_entries(model: KeptModel, fds: list[int]) -> list[Entry]:
    """What keeps ``model``, in order: each arena's descriptor (``fds``, rank order), then the
    model, which the keeper puts once its arenas came."""
    arenas: list[Entry] = [
        (ArenaFd(model=model.id, rank=arena.rank), [fd])
        for arena, fd in zip(model.arenas, fds, strict=True)
    ]
    return [*arenas, (PutModel(model=model), [])]


def spawn_keeper(run_dir: Path, shm_group: str | None) -> subprocess.Popen[bytes]:
    """``weight-cache keeper`` detached (its own session: a daemon's death does not take it
    along), logging to ``<run_dir>/keeper.log``."""
    args = [sys.executable, "-m", "weight_cache_cli", "keeper", "--run-dir", str(run_dir)]
    if shm_group:
        args += ["--shm-group", shm_group]
    with open(run_dir / KEEPER_LOG, "ab") as out:
        process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    # Reap it if it ends while this daemon runs (it is ours until then).
    threading.Thread(target=process.wait, name="keeper-reaper", daemon=True).start()
    log.info("started keeper pid %d on %s", process.pid, run_dir / KEEPER_SOCKET)
    return process


class KeeperLink:
    def __init__(
        self,
        run_dir: Path,
        mode: KeeperMode,
        boot_id: str,
        holdings: Holdings,
        shm_group: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.mode = mode  # auto, external or off
        self.boot_id = boot_id
        self.holdings = holdings
        self.shm_group = shm_group
        self._sock: socket.socket | None = None
        self._received: tuple[Snapshot, ArenaFds] | None = None
        self._queue: queue.Queue[Entry | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._resync = False
        self.pid: int | None = None  # the keeper attached to, as this process sees it
        self.started: bool = False  # this daemon started it (--keeper auto)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def path(self) -> Path:
        return self.run_dir / KEEPER_SOCKET

    @property
    def attached(self) -> bool:
        return self._sock is not None and not self._resync

    # --- attaching -----------------------------------------------------------------------------

    def connect(self, timeout_s: float = 10.0) -> None:
        """Attach to the keeper (start one with ``auto``) and receive what it holds; raises
        :class:`~protocol.errors.KeeperUnavailableError`. Nothing to do when off or attached."""
        if not self.enabled or self._sock is not None:
            return
        self._sock, self._received = self._attach(timeout_s, resync=False)

    def _attach(
        self, timeout_s: float, resync: bool
    ) -> tuple[socket.socket, tuple[Snapshot, ArenaFds]]:
        deadline = time.monotonic() + timeout_s
        if not answers(self.path) and self.mode == "auto":
            spawn_keeper(self.run_dir, self.shm_group)
            self.started = True
        while not answers(self.path):
            if time.monotonic() > deadline:
                raise KeeperUnavailableError(
                    f"no keeper answers on {self.path}"
                    + (
                        " (--keeper external: start `weight-cache keeper`)"
                        if self.mode == "external"
                        else ""
                    ),
                    socket=str(self.path),
                )
            time.sleep(0.05)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(str(self.path))
            self.pid = peer_credentials(sock)[0] or None
            send(sock, Attach(pid=os.getpid(), boot_id=self.boot_id, resync=resync))
            return sock, self._read_snapshot(sock)
        except (OSError, FramingError) as exc:
            sock.close()
            raise KeeperUnavailableError(f"the keeper on {self.path} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    def _read_snapshot(self, sock: socket.socket) -> tuple[Snapshot, ArenaFds]:
        got = receive(sock)
        if got is None:
            raise KeeperUnavailableError(f"the keeper on {self.path} hung up")
        reply = got[0]
        if isinstance(reply, Refused):
            raise KeeperUnavailableError(f"the keeper on {self.path} refused: {reply.detail}")
        if not isinstance(reply, Snapshot):
            raise KeeperUnavailableError(f"the keeper on {self.path} answered {reply.op}")
        fds: ArenaFds = {}
        try:
            for _ in range(sum(len(m.arenas) for m in reply.models)):
                arena = receive(sock, max_fds=1)
                if arena is None or not isinstance(arena[0], ArenaFd) or len(arena[1]) != 1:
                    if arena is not None:
                        _close(arena[1])
                    raise KeeperUnavailableError(f"the keeper on {self.path} sent a bad arena")
                fds[(arena[0].model, arena[0].rank)] = arena[1][0]
        except BaseException:
            _close(list(fds.values()))
            raise
        return reply, fds

    def take_snapshot(self) -> tuple[Snapshot, ArenaFds]:
        """What the keeper held at attach (the caller owns the descriptors); empty after."""
        received, self._received = self._received, None
        return received or (Snapshot(models=[], leases=[]), {})

    # --- the journal ---------------------------------------------------------------------------

    def start_journal(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="keeper-journal", daemon=True)
            self._thread.start()

    def put_model(self, model: KeptModel, fds: list[int]) -> None:
        """Keep ``model``; ``fds`` (its arenas' descriptors, rank order) become the link's."""
        if not self.enabled:
            _close(fds)
            return
        for entry in _model_entries(model, fds):
            self._queue.put(entry)

    def drop_model(self, model_id: str) -> None:
        if self.enabled:
            self._queue.put((DropModel(model=model_id), []))

    def put_lease(self, lease: KeptLease) -> None:
        if self.enabled:
            self._queue.put((PutLease(lease=lease), []))

    def drop_lease(self, lease_id: str) -> None:
        if self.enabled:
            self._queue.put((DropLease(lease=lease_id), []))

    def close(self) -> None:
        """Send what is queued, then detach (the keeper keeps everything for the next daemon)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(10)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._received is not None:
            _close(list(self.take_snapshot()[1].values()))

    def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                entry = self._queue.get(timeout=backoff if self._resync else None)
            except queue.Empty:
                backoff = self._try_reattach(backoff)
                continue
            if entry is None:
                return
            message, fds = entry
            try:
                if self._resync:  # what the resync sends covers this entry
                    continue
                assert self._sock is not None
                send(self._sock, message, fds)
            except (OSError, FramingError) as exc:
                log.warning("lost the keeper (%s); attaching again", exc)
                self._resync = True
            finally:
                _close(fds)
            if self._resync:
                backoff = self._try_reattach(0.1)

    def _try_reattach(self, backoff: float) -> float:
        """Attach again and send everything; the next wait before another try if it failed."""
        try:
            self._reattach()
        except (OSError, FramingError, KeeperUnavailableError) as exc:
            log.warning("keeper still unavailable (%s); retrying in %.1f s", exc, backoff)
            return min(backoff * 2, 30.0)
        return 0.1

    def _reattach(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        sock, (_, stale) = self._attach(10.0, resync=True)
        _close(list(stale.values()))
        try:
            models, leases = self.holdings()
            for model, fds in models:
                try:
                    for message, sent in _model_entries(model, fds):
                        send(sock, message, sent)
                finally:
                    _close(fds)
            for lease in leases:
                send(sock, PutLease(lease=lease))
        except BaseException:
            sock.close()
            raise
        self._sock, self._resync = sock, False
        log.info("keeper attached again: %d model(s), %d lease(s) sent", len(models), len(leases))

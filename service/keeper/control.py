"""Asking a keeper what it holds, and stopping it, from outside a daemon (``weight-cache keeper
--stop``, ``serve``'s last words, the tests): one connection to ``<run_dir>/keeper.sock``."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from protocol.fd_passing import FramingError, peer_credentials
from service.keeper.messages import Status, StatusReply
from service.keeper.wire import receive, send
from service.run_dir import KEEPER_SOCKET, answers

_REPLY_BYTES = 1 << 20


def keeper_status(run_dir: Path, timeout_s: float = 10.0) -> StatusReply | None:
    """What the keeper on ``run_dir`` holds, or None when none answers. Its ``pid`` is the
    keeper's process as this one sees it (the socket's peer), 0 when the keeper runs in a PID
    namespace this process cannot see (another container)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(Path(run_dir) / KEEPER_SOCKET))
            pid = peer_credentials(sock)[0]
            send(sock, Status())
            got = receive(sock, _REPLY_BYTES)
        except (OSError, FramingError):  # none there, or one stopping (it closes what it had)
            return None
    if got is None or not isinstance(got[0], StatusReply):
        return None
    return got[0].model_copy(update={"pid": pid})


def stop_keeper(run_dir: Path, timeout_s: float = 30.0) -> StatusReply | None:
    """Stop the keeper on ``run_dir`` (SIGTERM: it lets go of everything it holds; engines that
    map an arena keep it) and wait until its socket no longer answers. Returns what it held, or
    None when none answered; raises ``ProcessLookupError`` for a keeper this process cannot
    see and ``TimeoutError`` when it is still there after ``timeout_s``."""
    status = keeper_status(run_dir)
    if status is None:
        return None
    if status.pid <= 0:
        raise ProcessLookupError(
            f"the keeper on {Path(run_dir) / KEEPER_SOCKET} runs in another PID namespace: "
            "stop it where it runs (its container)"
        )
    os.kill(status.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while answers(Path(run_dir) / KEEPER_SOCKET):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the keeper (pid {status.pid}) is still running")
        time.sleep(0.05)
    return status

"""The daemon's handle socket, as both sides speak it: an engine holding a lease asks for one
arena's descriptor and gets it by ``SCM_RIGHTS``, or a typed refusal.

The lease still comes from the REST API; the socket only passes descriptors, to the process
that holds the lease (the daemon checks the peer's credentials and the lease's secret).
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocol.errors import ArenaUnavailableError, error_from_problem
from protocol.fd_passing import FramingError, receive_message, send_message
from protocol.reasons import Reason
from protocol.schemas.manifest import HandleAccess

MAX_REQUEST_BYTES = 4096
MAX_ANSWER_BYTES = 64 * 1024


class HandleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lease: str = Field(min_length=1, max_length=160)
    secret: str = Field(min_length=1, max_length=160)
    arena: int = Field(ge=0, le=1024)


class HandleAnswer(BaseModel):
    """``ok`` with the descriptor attached, or the problem document of the refusal."""

    model_config = ConfigDict(extra="forbid")

    ok: bool
    size: int | None = Field(default=None, description="bytes the descriptor maps")
    problem: dict[str, Any] | None = None


class SocketUnreachableError(ArenaUnavailableError):
    """Nothing answers at the handle socket's path from here (not shared with this process, or
    no daemon): a shared-memory arena can still be mapped by its path."""


def fetch_arena_fd(
    access: HandleAccess,
    lease: str,
    arena: int,
    socket_path: str | None = None,
    timeout_s: float = 10.0,
) -> tuple[int, int]:
    """(descriptor, size) of arena ``arena`` of lease ``lease``, from the handle socket at
    ``socket_path`` (default: the one the grant names). The caller owns the descriptor. A
    refusal raises the daemon's typed error (``handle_refused``)."""
    path = socket_path or access.socket
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(path)
        except OSError as exc:
            unreachable = exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR)
            cls = SocketUnreachableError if unreachable else ArenaUnavailableError
            raise cls(
                f"cannot reach the daemon's handle socket {path}: {exc.strerror or exc} (share "
                "the daemon's run directory, /run/weight-cache in containers, or set the "
                "loader's handle_socket)",
                reason=Reason.arena_unavailable,
                file=path,
            ) from exc
        try:
            send_message(sock, HandleRequest(lease=lease, secret=access.secret, arena=arena))
            got = receive_message(sock, HandleAnswer, MAX_ANSWER_BYTES, max_fds=1)
        except (OSError, FramingError) as exc:
            raise ArenaUnavailableError(
                f"the handle socket {path} did not answer: {exc}",
                reason=Reason.arena_unavailable,
                file=path,
            ) from exc
    finally:
        sock.close()
    if got is None:
        raise ArenaUnavailableError(
            f"the handle socket {path} closed without an answer",
            reason=Reason.arena_unavailable,
            file=path,
        )
    answer, fds = got
    if answer.ok and len(fds) == 1 and answer.size is not None:
        return fds[0], answer.size
    for fd in fds:
        os.close(fd)
    if answer.problem is not None:
        raise error_from_problem(answer.problem, int(answer.problem.get("status", 403)))
    raise ArenaUnavailableError(
        f"the handle socket {path} answered without a descriptor",
        reason=Reason.arena_unavailable,
        file=path,
    )

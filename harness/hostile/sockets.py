"""Raw HTTP over a socket, as a hostile client speaks it: connect (with a small receive window
if asked), send until the daemon closes, read what it wrote before closing. Used by the hostile
tests and by ``bench.hostile``."""

from __future__ import annotations

import contextlib
import socket


def connect(port: int, rcvbuf: int | None = None, timeout_s: float = 10) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:  # a small window: the daemon's answers back up at once
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout_s)
    s.connect(("127.0.0.1", port))
    return s


def send_until_closed(s: socket.socket, head: bytes, chunk: bytes, most: int) -> int:
    """Send ``head`` then ``chunk`` repeatedly, up to ``most`` bytes; how many were sent before
    the daemon closed the connection (or stopped reading it past the socket's timeout)."""
    sent = 0
    with contextlib.suppress(OSError):
        s.sendall(head)
        while sent < most:
            s.sendall(chunk)
            sent += len(chunk)
    return sent


def read_all(s: socket.socket, until_closed: bool = False) -> bytes:
    """Everything the daemon writes until it closes (or resets); at the socket's timeout, what
    came so far, or ``TimeoutError`` when ``until_closed`` (the daemon had to close it)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        if until_closed:
            raise
    except OSError:
        pass
    return data


def send_until_answered(
    port: int, head: bytes, chunk: bytes, most: int, timeout_s: float = 10
) -> tuple[int, bytes]:
    """On a new connection, :func:`send_until_closed`, then :func:`read_all`: how many bytes
    of ``chunk`` were sent, and what the daemon wrote."""
    s = connect(port, timeout_s=timeout_s)
    try:
        return send_until_closed(s, head, chunk, most), read_all(s)
    finally:
        s.close()


def status_in(answer: bytes) -> int:
    """The status of an answer's bytes (0: none)."""
    try:
        return int(answer.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def status_of(s: socket.socket) -> int:
    """The status of what the daemon wrote before closing (0: nothing)."""
    return status_in(read_all(s))

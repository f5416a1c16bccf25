"""What a connection's socket holds unread, both ways, and a reset that leaves none of it
behind (for a client that does not read)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset
_INT = struct.Struct("i")


def reset(transport: asyncio.Transport) -> None:
    """Abort with a reset: neither the transport nor the kernel keeps unread bytes for a client
    that does not read (a plain close leaves them queued in an orphan)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


def unsent(transport: asyncio.Transport) -> int:
    """Bytes written and not yet read by the client: in the transport and the kernel."""
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, _INT.pack(0))
            queued += _INT.unpack(raw)[0]
    return int(queued)


def waiting(transport: asyncio.Transport) -> int:
    """Bytes the client sent that the daemon has not read yet (in the kernel)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, _INT.pack(0))
    except OSError:
        return 0
    return int(_INT.unpack(raw)[0])

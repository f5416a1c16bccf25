"""Messages with file descriptors over a Unix stream socket: the framing the handle socket and
the keeper's socket share.

A message is a 4-byte big-endian length and that many bytes of JSON (a pydantic model); the
descriptors it carries travel as ``SCM_RIGHTS`` with its first bytes (``socket.send_fds`` /
``socket.recv_fds``, the standard library's own wrappers of ``sendmsg``/``recvmsg``). The reader
takes the length first, with the descriptors, then exactly the payload, so two messages sent
back to back never blur and descriptors are never handed to the wrong message. Every
descriptor received is close-on-exec; one the reader did not expect is closed, never leaked.
"""

from __future__ import annotations

import array
import os
import socket
import struct
from typing import TypeVar

from pydantic import BaseModel, ValidationError

_LENGTH = struct.Struct(">I")
MAX_FDS = 16  # most descriptors one message may carry
T = TypeVar("T", bound=BaseModel)


class FramingError(Exception):
    """The peer sent something that is not a message of this protocol (or went away)."""


def send_message(
    sock: socket.socket, message: BaseModel, fds: list[int] | tuple[int, ...] = ()
) -> None:
    """Send ``message`` and, with its first bytes, ``fds`` (they stay open here)."""
    payload = message.model_dump_json().encode()
    data = _LENGTH.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _length(head: bytes | bytearray, max_bytes: int) -> int:
    """The payload length ``head`` begins with; :class:`FramingError` past ``max_bytes``."""
    (length,) = _LENGTH.unpack_from(head)
    if length > max_bytes:
        raise FramingError(f"a message of {length} bytes (at most {max_bytes})")
    return int(length)


def framed_payload(data: bytes | bytearray, max_bytes: int) -> bytes | None:
    """The payload of the message ``data`` begins with, once all of it has come (None
    before); :class:`FramingError` as soon as its length passes ``max_bytes``. For a reader
    that gathers bytes as they come, never waiting on one peer."""
    if len(data) < _LENGTH.size:
        return None
    end = _LENGTH.size + _length(data, max_bytes)
    return bytes(data[_LENGTH.size : end]) if len(data) >= end else None


def _exactly(sock: socket.socket, nbytes: int) -> bytes:
    chunks = []
    while nbytes:
        chunk = sock.recv(min(nbytes, 1 << 20))
        if not chunk:
            raise FramingError("the peer closed the connection inside a message")
        chunks.append(chunk)
        nbytes -= len(chunk)
    return b"".join(chunks)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def receive_raw(sock: socket.socket, max_bytes: int) -> tuple[bytes, list[int]] | None:
    """The next message's payload and descriptors, or None at a clean end of the stream."""
    head, fds, flags, _ = socket.recv_fds(sock, _LENGTH.size, MAX_FDS)
    try:
        if flags & socket.MSG_CTRUNC:
            raise FramingError(f"more than {MAX_FDS} descriptors in one message")
        if not head:
            if fds:
                raise FramingError("descriptors without a message")
            return None
        if len(head) < _LENGTH.size:
            head += _exactly(sock, _LENGTH.size - len(head))
        return _exactly(sock, _length(head, max_bytes)), fds
    except BaseException:
        _close_all(fds)
        raise


def receive_message(
    sock: socket.socket, model: type[T], max_bytes: int, max_fds: int = 0
) -> tuple[T, list[int]] | None:
    """The next message as ``model`` with its descriptors (the caller closes them), or None at
    the end of the stream. A payload that is not a ``model``, or more descriptors than
    ``max_fds``, raises :class:`FramingError` with every descriptor closed."""
    raw = receive_raw(sock, max_bytes)
    if raw is None:
        return None
    payload, fds = raw
    try:
        if len(fds) > max_fds:
            raise FramingError(f"{len(fds)} descriptors where at most {max_fds} were expected")
        return decode_message(model, payload), fds
    except BaseException:
        _close_all(fds)
        raise


def decode_message(model: type[T], payload: bytes) -> T:
    """``payload`` as ``model``; :class:`FramingError` when it is not one."""
    try:
        return model.model_validate_json(payload)
    except ValidationError as exc:
        raise FramingError(f"not a {model.__name__}: {exc.errors()[0]['msg']}") from exc


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it connect
    (``SO_PEERCRED``): the pid is 0 when that process is in a PID namespace this one cannot
    see, and ids are those of this process's user namespace."""
    creds = array.array("i", [0, 0, 0])
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.itemsize * 3)
    creds = array.array("i")
    creds.frombytes(raw)
    return creds[0], creds[1], creds[2]

"""Keeper messages on a socket: each travels in an :class:`Envelope`, so that the reader decodes
whichever message comes with one model, and descriptors ride along (``SCM_RIGHTS``)."""

from __future__ import annotations

import socket

from protocol.fd_passing import receive_message, send_message
from service.keeper.messages import MAX_MESSAGE_BYTES, Envelope, Message


def send(sock: socket.socket, message: Message, fds: list[int] | tuple[int, ...] = ()) -> None:
    send_message(sock, Envelope(message=message), fds)


def receive(
    sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES, max_fds: int = 0
) -> tuple[Message, list[int]] | None:
    """The next message and the descriptors that came with it (the caller's to close), or None
    when the peer hung up."""
    got = receive_message(sock, Envelope, max_bytes, max_fds)
    if got is None:
        return None
    envelope, fds = got
    return envelope.message, fds

"""Messages with descriptors over a Unix socket pair: the descriptor arrives with its message,
messages sent back to back stay apart, and anything unexpected is closed, never leaked."""

from __future__ import annotations

import os
import socket

import pytest

from protocol.fd_passing import FramingError, peer_credentials, receive_message, send_message
from protocol.handle_socket import HandleAnswer, HandleRequest


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_descriptor_travels_with_its_message() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    with a, b:
        send_message(a, HandleAnswer(ok=True, size=5), [r])
        send_message(a, HandleAnswer(ok=False))  # right behind it, without a descriptor
        got = receive_message(b, HandleAnswer, 1024, max_fds=1)
        assert got is not None
        answer, fds = got
        assert answer.size == 5 and len(fds) == 1 and fds[0] != r
        os.write(w, b"hello")
        assert os.read(fds[0], 5) == b"hello"  # the same pipe, through another descriptor
        os.close(fds[0])
        second = receive_message(b, HandleAnswer, 1024, max_fds=1)
        assert second is not None and second[0].ok is False and second[1] == []
        a.close()
        assert receive_message(b, HandleAnswer, 1024) is None  # a clean end
    os.close(r)
    os.close(w)


def test_unexpected_descriptors_and_bad_payloads_are_closed() -> None:
    before = open_fds()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    with a, b:
        send_message(a, HandleRequest(lease="l", secret="s", arena=0), [r, w])
        with pytest.raises(FramingError, match="descriptors"):
            receive_message(b, HandleRequest, 1024, max_fds=1)
        send_message(a, HandleAnswer(ok=True), [r])
        with pytest.raises(FramingError, match="not a HandleRequest"):
            receive_message(b, HandleRequest, 1024, max_fds=1)
        a.sendall(b"\xff\xff\xff\xff")
        with pytest.raises(FramingError, match="bytes"):
            receive_message(b, HandleRequest, 1024)
        assert peer_credentials(b)[1:] == (os.geteuid(), os.getegid())
    os.close(r)
    os.close(w)
    assert open_fds() == before

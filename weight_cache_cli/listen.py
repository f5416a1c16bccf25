"""Where ``serve`` listens, bound before any model loads, and how it stops.

A taken address, a socket file that is not a socket or that another daemon serves on, is one line
and an exit status. The Unix socket is the daemon's own (:mod:`service.api.unix_socket`: 0600,
or 0660 for ``--socket-group``) and is removed at shutdown: uvicorn re-raises the signal that
stopped it once it has shut down, which would end the process before that, so the signal is
caught instead (:func:`stopping_signal_deferred`) and the daemon ends as a stop asked for ends:
status 0, saying what stays.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from protocol.client_settings import client_setting

_PORT = client_setting("port")  # the daemon's --port, declared once for daemon and clients

if TYPE_CHECKING:
    from service.api.unix_socket import PrivateSocket
    from service.settings import DaemonSettings


def bind(settings: DaemonSettings) -> tuple[socket.socket, Callable[[], None]]:
    """The listening socket, bound before any model loads, and what closes it (a Unix
    socket's file removed with it); a taken address is one line (an unknown
    ``--socket-group`` is a ``ValueError``)."""
    if settings.uds is not None:
        private = _bind_unix(settings.uds, settings.socket_group)

        def close() -> None:
            private.sock.close()
            private.remove()

        return private.sock, close
    sock = _bind_tcp(settings.host, settings.port)
    return sock, sock.close


def _bind_tcp(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"cannot listen on {host}:{port}: the address is in use (another weight-cache "
                f"daemon?); stop it, or choose another {_PORT.flag} / {_PORT.variable}"
            ) from exc
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


def _bind_unix(path: Path, group: str | None) -> PrivateSocket:
    from service.api.unix_socket import PrivateSocket

    if path.exists():
        if not stat.S_ISSOCK(path.stat().st_mode):
            raise click.ClickException(f"cannot listen on {path}: it exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # left behind by a daemon that is gone
            else:
                raise click.ClickException(
                    f"cannot listen on {path}: another process is serving on it; stop it, or "
                    "choose another --uds"
                )
    try:
        # 0600, or 0660 for --socket-group (an unknown group is a ValueError: a bad setting).
        return PrivateSocket(path, group)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {path}: {exc.strerror}") from exc


@contextlib.contextmanager
def stopping_signal_deferred() -> Iterator[list[int]]:
    """SIGINT and SIGTERM ask the daemon to stop: uvicorn shuts down on them and then raises
    the signal again, which would end the process before the socket file is removed (and
    Ctrl-C would print a traceback or "Aborted!" and exit 1). The signals are caught here
    instead and yielded: the daemon stops cleanly and exits 0. One that came before uvicorn
    took over (during imports, or while the daemon was built) means the daemon is not to
    serve at all."""
    caught: list[int] = []
    stopping = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda sig, _: caught.append(sig)) for sig in stopping}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

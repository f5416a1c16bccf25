"""Who is at the other end of a connection, as the kernel says (never as the client says).

On a Unix socket the kernel hands the peer's credentials to ``SO_PEERCRED``: its uid, gid and
pid, the pid translated into the daemon's PID namespace (0 when the peer's process is not visible
there: another PID namespace). On loopback TCP the uid that owns the client's end of the
connection is the kernel's ``sock_diag`` answer for that exact address pair (one netlink request,
no scan), else the ``uid`` column of its line in ``/proc/net/tcp`` / ``/proc/net/tcp6``; TCP
tells no pid. A remote peer has no local socket: its uid is unknown.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.fd_passing import peer_credentials

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG_HEADER = struct.Struct("=IHHII")
_INET_DIAG_REQ = struct.Struct("=BBBBI")  # family, protocol, ext, pad, states
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
# inet_diag_msg: family, state, timer, retrans (4 bytes), its sockid (48), then expires, rqueue,
# wqueue, uid and inode.
_DIAG_MSG = struct.Struct("=IIIII")
_DIAG_OFFSET = _NLMSG_HEADER.size + 4 + 48
_TCP_ESTABLISHED, _TCP_CLOSE_WAIT, _TCP_LISTEN = 1, 8, 10


@dataclass(frozen=True)
class PeerCredentials:
    """A connection's peer as the kernel proved it."""

    uid: int | None  # None: not known (a remote TCP peer, or no way to ask)
    pid: int | None  # in the daemon's PID namespace; None over TCP or from another namespace
    via: str  # "unix" or "tcp"


def unix_credentials(sock: Any) -> PeerCredentials | None:
    """``SO_PEERCRED`` of a Unix-socket connection (``None`` for any other socket)."""
    if getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    pid, uid, _gid = peer_credentials(sock)
    return PeerCredentials(uid=uid, pid=pid or None, via="unix")


def _packed(host: str) -> tuple[int, bytes]:
    address = ipaddress.ip_address(host.split("%", 1)[0])
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    return family, address.packed


@dataclass(frozen=True)
class TcpSocket:
    """What ``sock_diag`` says of one TCP socket of this host."""

    uid: int  # its owner
    receive_queue: int  # bytes received and not yet read by its process
    send_queue: int  # bytes written and not yet acknowledged by the other end
    state: int  # the kernel's TCP state (1 established, 8 close-wait: still held open)

    @property
    def held_open(self) -> bool:
        """Whether its process still holds it (it has not closed its end)."""
        return self.state in (_TCP_ESTABLISHED, _TCP_CLOSE_WAIT)


def tcp_socket(local: tuple[str, int], remote: tuple[str, int]) -> TcpSocket | None:
    """The kernel's own lookup of the TCP socket ``local -> remote`` (``None``: no such socket
    in this network namespace, e.g. the far end of a remote connection)."""
    family, src = _packed(local[0])
    family_dst, dst = _packed(remote[0])
    if family != family_dst:
        return None
    sockid = (
        struct.pack(">HH", local[1], remote[1])
        + src.ljust(16, b"\0")
        + dst.ljust(16, b"\0")
        + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
    )
    body = _INET_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + sockid
    head = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(head + body, (0, 0))
        answer = nl.recv(8192)
    _, kind, _, _, _ = _NLMSG_HEADER.unpack_from(answer)
    if kind == _NLMSG_ERROR or len(answer) < _DIAG_OFFSET + _DIAG_MSG.size:
        return None
    state = answer[_NLMSG_HEADER.size + 1]
    (dport,) = struct.unpack_from(">H", answer, _NLMSG_HEADER.size + 6)
    if state == _TCP_LISTEN or dport != remote[1]:
        return None  # the kernel's lookup fell back to a listener: the connection is gone
    _, receive_queue, send_queue, uid, _ = _DIAG_MSG.unpack_from(answer, _DIAG_OFFSET)
    return TcpSocket(uid=uid, receive_queue=receive_queue, send_queue=send_queue, state=state)


def _proc_hex(host: str, port: int) -> str:
    """An address as ``/proc/net/tcp{,6}`` prints it (32-bit words in host byte order)."""
    _, packed = _packed(host)
    words = [packed[i : i + 4] for i in range(0, len(packed), 4)]
    text = "".join(f"{int.from_bytes(w, sys.byteorder):08X}" for w in words)
    return f"{text}:{port:04X}"


def _proc_net_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The same answer from ``/proc/net/tcp`` or ``tcp6``, line by line."""
    family, _ = _packed(client[0])
    table = Path("/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6")
    local, remote = _proc_hex(*client), _proc_hex(*server)
    with table.open() as lines:
        next(lines, None)
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                return int(fields[7])
    return None


PEER_KEY = "weight_cache.peer"  # ASGI scope key: the request's connection's ConnectionPeer


class ConnectionPeer:
    """One connection's peer, found once: Unix credentials when the connection is made, a TCP
    peer's uid the first time a request needs it (cached for the connection's later requests)."""

    def __init__(self, unix: PeerCredentials | None) -> None:
        self._credentials = unix

    def resolve_quickly(
        self, client: tuple[str, int] | None, server: tuple[str, int] | None
    ) -> bool:
        """Find a TCP peer's uid with the one netlink request ``sock_diag`` takes (the kernel
        answers it while the request is sent: fine on the event loop); ``False`` when that is
        not to be had here and :meth:`credentials` would read ``/proc/net/tcp`` instead."""
        if self._credentials is not None:
            return True
        if client is None or server is None:
            self._credentials = PeerCredentials(None, None, "tcp")
            return True
        try:
            found = tcp_socket(client, server)
        except (OSError, ValueError):
            return False
        uid = None if found is None else found.uid
        self._credentials = PeerCredentials(uid, None, "tcp")
        return True

    def credentials(
        self, client: tuple[str, int] | None, server: tuple[str, int] | None
    ) -> PeerCredentials:
        """The peer's credentials; for a TCP peer :meth:`resolve_quickly` could not find, its
        uid read from ``/proc/net/tcp`` (blocking: called off the event loop)."""
        if self._credentials is None:
            uid = None
            if client is not None and server is not None:
                with contextlib.suppress(OSError, ValueError):
                    uid = _proc_net_uid(client, server)
            self._credentials = PeerCredentials(uid, None, "tcp")
        return self._credentials

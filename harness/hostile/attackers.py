"""Hostile clients written with the standard library alone, so that a process dropped to another
user can run them (:func:`harness.hostile.users.run_attacker`) as well as this one: a body sent in
chunks of one byte, connections held open by the thousand, and bytes trickled into the handle
socket. Each runs for a bounded time against a loopback address or a Unix socket of this host,
stops by itself, and reports what it saw as a dict of counts (JSON when run as a module)."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

TINY_CHUNK = b"1\r\n \r\n"  # one byte of body, five of framing
PAID_CHUNK = b"400\r\n" + b" " * 1024 + b"\r\n"  # 1 KiB of body: chunks an honest client sends
# A lease request's head, its headers still open: what ends them and what follows is the attack.
LEASE_POST = b"POST /v1/leases HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
CHUNKED_POST = LEASE_POST + b"transfer-encoding: chunked\r\n"
# A chunked body that ends, then a trailer line that never does.
ENDLESS_TRAILER = CHUNKED_POST + b"\r\n2\r\n{}\r\n0\r\nX-Trailer: "


def _status(data: bytes) -> str:
    """The status of the first answer in ``data`` ("none" when nothing came)."""
    if not data.startswith(b"HTTP/1.1 "):
        return "none"
    return data[9:12].decode("ascii", "replace")


def _read_answer(s: socket.socket) -> bytes:
    """What the daemon wrote until it closed, or what came within the socket's timeout."""
    data = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            data += chunk
    return data


def chunked_posts(
    port: int,
    connections: int,
    seconds: float,
    chunk: bytes = TINY_CHUNK,
    headers: bytes = b"",
) -> dict[str, Any]:
    """``connections`` threads, each sending a chunked ``POST /v1/leases`` whose body is
    ``chunk`` (one byte of body by default) again and again, about 6 KB per write, until the
    daemon closes the connection, then again on a new one, for ``seconds``. ``headers``: extra
    header lines (a token, say)."""
    deadline = time.monotonic() + seconds
    statuses: Counter[str] = Counter()
    sent = [0]
    lock = threading.Lock()
    burst = chunk * max(1, 6000 // len(chunk))

    def attack() -> None:
        while time.monotonic() < deadline:
            s = socket.socket()
            s.settimeout(1.0)
            n = 0
            try:
                s.connect(("127.0.0.1", port))
                s.sendall(CHUNKED_POST + headers + b"\r\n")
                while time.monotonic() < deadline:
                    s.sendall(burst)
                    n += len(burst)
            except OSError:
                pass
            s.settimeout(0.5)
            status = _status(_read_answer(s))
            s.close()
            with lock:
                statuses[status] += 1
                sent[0] += n

    threads = [threading.Thread(target=attack) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return {"requests": sum(statuses.values()), "bytes": sent[0], "statuses": dict(statuses)}


def connection_flood(
    port: int, kinds: dict[str, tuple[bytes, int]], seconds: float
) -> dict[str, Any]:
    """Hold ``count`` connections of each kind open, each sending ``head`` (nothing for b"")
    once connected and again after each answer it gets on a connection still open; a
    connection the daemon closes is made again at once. One thread, one selector, ``seconds``
    long. Counts per kind: connections made, closed by the daemon, answers by status."""
    sel = selectors.DefaultSelector()
    seen: dict[str, Counter[str]] = {kind: Counter() for kind in kinds}
    deadline = time.monotonic() + seconds

    def open_one(kind: str) -> None:
        head = kinds[kind][0]
        s = socket.socket()
        s.settimeout(2.0)
        try:
            s.connect(("127.0.0.1", port))
            if head:
                s.sendall(head)
        except OSError:
            seen[kind]["connect_failed"] += 1
            s.close()
            return
        s.setblocking(False)
        seen[kind]["made"] += 1
        sel.register(s, selectors.EVENT_READ, kind)

    for kind, (_, count) in kinds.items():
        for _ in range(count):
            open_one(kind)
    try:
        while time.monotonic() < deadline:
            for key, _ in sel.select(0.05):
                s, kind = key.fileobj, key.data
                assert isinstance(s, socket.socket)
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    seen[kind][_status(data)] += data.startswith(b"HTTP/1.1 ")
                    with contextlib.suppress(OSError):
                        if kinds[kind][0]:
                            s.send(kinds[kind][0])
                    continue
                seen[kind]["closed"] += 1
                sel.unregister(s)
                s.close()
                if time.monotonic() < deadline:
                    open_one(kind)
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()
    return {kind: dict(counts) for kind, counts in seen.items()}


def trickle(path: str, connections: int, seconds: float, every_s: float) -> dict[str, Any]:
    """``connections`` connections to the Unix socket ``path``, each sending one byte of a
    plausible request every ``every_s`` seconds, made again when the daemon closes them, for
    ``seconds``. Counts: connections made, refused at connect, closed by the daemon."""
    request = b"\x00\x00\x00\x40" + b"{" + b" " * 62 + b"}"
    seen: Counter[str] = Counter()
    held: list[tuple[socket.socket, int]] = []
    deadline = time.monotonic() + seconds

    def open_one() -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            seen["connect_failed"] += 1
            s.close()
            return
        seen["made"] += 1
        held.append((s, 0))

    for _ in range(connections):
        open_one()
    while time.monotonic() < deadline:
        for i, (s, at) in enumerate(list(held)):
            try:
                s.send(request[at : at + 1])
                held[i] = (s, (at + 1) % len(request))
            except OSError:
                seen["closed"] += 1
                s.close()
                held[i] = (s, -1)
        closed = sum(at < 0 for _, at in held)
        held[:] = [(s, at) for s, at in held if at >= 0]
        for _ in range(closed):
            open_one()
        time.sleep(min(every_s, max(0.0, deadline - time.monotonic())))
    for s, _ in held:
        s.close()
    return dict(seen)


def main() -> None:
    """``python -m harness.hostile.attackers NAME JSON-ARGS``: run one, print its counts."""
    name, args = sys.argv[1], json.loads(sys.argv[2])
    if name == "connection_flood":
        args["kinds"] = {k: (v[0].encode("latin-1"), v[1]) for k, v in args["kinds"].items()}
    for name_of_bytes in ("headers", "chunk"):
        if name_of_bytes in args:
            args[name_of_bytes] = args[name_of_bytes].encode("latin-1")
    attacks: dict[str, Callable[..., dict[str, Any]]] = {
        "chunked_posts": chunked_posts,
        "connection_flood": connection_flood,
        "trickle": trickle,
    }
    print(json.dumps(attacks[name](**args)), flush=True)


if __name__ == "__main__":
    main()

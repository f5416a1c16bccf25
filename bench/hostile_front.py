"""Hostile HTTP clients: huge headers and trailers, half-sent requests, connection floods,
requests pipelined without reading, idle connections parked at the cap, bodies in chunks of one
byte, and an allowed user's thousand connections."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.hostile_tools import Result, Target, connect, send_until_answered
from harness.hostile import attackers
from harness.hostile.probe import FreshProbe
from harness.hostile.sockets import read_all, status_in, status_of
from harness.hostile.users import NOBODY, run_attacker
from harness.waiting import poll
from service.api.peer import tcp_socket


def _big_header(target: Target) -> int:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
    _, answer = send_until_answered(target, head, b"a" * 65536, 100 << 20)
    return status_in(answer)


def one_header(target: Target, work: Path) -> Result:
    return 1, int(_big_header(target) == 431), "431 headers_too_large"


def four_headers(target: Target, work: Path) -> Result:
    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(_big_header(target))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return 4, out.count(431), "431 headers_too_large"


def trailers(target: Target, work: Path) -> Result:
    """A chunked body followed by a 200 MB trailer, as one unauthenticated connection (the
    probe sent 900 MB and grew the daemon by 876 MB, kept after close)."""
    sent, answer = send_until_answered(target, attackers.ENDLESS_TRAILER, b"a" * 65536, 200 << 20)
    return 1, int(status_in(answer) == 431), f"431 after {sent >> 20} MiB of trailer sent"


def slowloris(target: Target, work: Path) -> Result:
    socks = [connect(target) for _ in range(200)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    statuses = [status_of(s) for s in socks]  # each closed by the 10 s request deadline
    for s in socks:
        s.close()
    return 200, statuses.count(408), "408 request_timeout"


def _closed_with(s: socket.socket) -> int:
    """The status the daemon closed ``s`` with; 0 for a close without an answer, -1 when it
    is still open (nothing within the socket's timeout)."""
    try:
        data = read_all(s, until_closed=True)
    except TimeoutError:
        return -1
    return status_in(data)


def connection_flood(target: Target, work: Path) -> Result:
    """5,000 half-sent connections, 500 at a time: each is answered (503 when the oldest
    half-sent one makes way for a newer one, or all are busy; 408 at the request deadline)."""
    answered = tried = 0
    for _ in range(10):
        socks = [connect(target) for _ in range(500)]
        tried += len(socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.sendall(b"GET /he")  # half a request, never finished
        for s in socks:
            s.settimeout(15)
            answered += _closed_with(s) in (0, 408, 503)  # 0: closed before it sent a byte
        for s in socks:
            s.close()
    return tried, answered, "each closed: 503 or silently to make way, 408 at the deadline"


def pipelined_unread(target: Target, work: Path) -> Result:
    """20 connections pipeline GET /health one request per read and never read an answer
    (the probe pinned every slot for 90 s and grew the daemon by 1 GB from 17 MB sent)."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    cut: list[bool] = []

    def flood() -> None:
        s = connect(target)
        daemon_end = (s.getpeername(), s.getsockname())
        try:
            for _ in range(2000):
                s.sendall(request)
                deadline = time.monotonic() + 1
                while time.monotonic() < deadline:  # until the daemon has read it
                    found = tcp_socket(*daemon_end)
                    if found is None or found.receive_queue == 0:
                        break
                    time.sleep(0.001)
        except OSError:
            cut.append(True)
        else:  # never too far ahead: it is closed (or reset) once it idles

            def held() -> bool:
                found = tcp_socket(*daemon_end)
                return found is not None and found.held_open

            deadline = time.monotonic() + 20
            while held() and time.monotonic() < deadline:
                time.sleep(0.1)
            cut.append(not held())
        s.close()

    threads = [threading.Thread(target=flood) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return 20, cut.count(True), "closed past 32 unanswered, or once idle"


def idle_at_cap(target: Target, work: Path) -> Result:
    """300 idle connections parked (the cap is 256), then 50 newcomers each ask /health."""
    parked = []
    try:
        for i in range(300):
            s = connect(target)
            if i % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                with contextlib.suppress(OSError):
                    s.recv(65536)
            parked.append(s)
        served = 0
        for _ in range(50):
            with contextlib.suppress(httpx.HTTPError):
                served += httpx.get(f"{target.url}/health", timeout=5).status_code == 200
    finally:
        for s in parked:
            s.close()
    return 50, served, "newcomers served while idle connections fill the cap"


def tiny_chunks(target: Target, work: Path) -> Result:
    """One allowed connection sends a chunked body in chunks of one byte, again on a new
    connection each time it is closed, for 8 s (the probe's kept a core busy: /health p50
    593 ms, max 1.4 s)."""
    seen = attackers.chunked_posts(target.daemon.port, 1, 8.0)
    return _refused_chunks(seen)


def tiny_chunks_refused_user(target: Target, work: Path) -> Result:
    """16 connections of a user the daemon refuses over TCP (403 ``peer_not_allowed``) send
    chunks of one byte, each again on a new connection once closed, for 8 s (four such held
    /health up to 5.0 s)."""
    seen = run_attacker(
        NOBODY, "chunked_posts", port=target.daemon.port, connections=16, seconds=8.0
    )
    return _refused_chunks(seen)


def tiny_chunks_without_token(target: Target, work: Path) -> Result:
    """The same 16 connections without the token a daemon requires (401)."""
    seen = attackers.chunked_posts(target.daemon.port, 16, 8.0)
    return _refused_chunks(seen)


def _refused_chunks(seen: dict[str, Any]) -> Result:
    statuses: dict[str, int] = seen["statuses"]
    ended = sum(n for status, n in statuses.items() if status in ("400", "401", "403", "431"))
    per = seen["bytes"] / max(1, seen["requests"])
    how = f"answers {statuses}, {per / 1024:.0f} KiB sent per request"
    return seen["requests"], ended, how


def allowed_flood(target: Target, work: Path) -> Result:
    """1,000 connections of one allowed user for 15 s: 300 long-polls on its own parked
    engine (wait_s=60), 300 chunked POSTs that send only their headers, 400 that send nothing,
    each made again as soon as the daemon closes it (260 long-polls made every new connection
    answer 503 for 60 s). Meanwhile new connections ask /health and /ready every 50 ms: held
    counts those answered 200."""
    with httpx.Client(base_url=target.url, timeout=30) as client:
        r = client.post(
            "/v1/parking",
            json={
                "model": "qwen",
                "tp_rank": 0,
                "tp_size": 1,
                "client_pid": os.getpid(),
                "group": f"flood-{uuid.uuid4().hex[:8]}",
            },
        )
        parked = r.json()["id"]
        long_poll = f"GET /v1/parking/{parked}?wait_s=60 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        kinds = {
            "long_poll": (long_poll, 300),
            "headers_only": (attackers.CHUNKED_POST + b"\r\n", 300),
            "silent": (b"", 400),
        }
        result = _probed_flood(target, kinds)
        # Once the daemon has let go of the flood's long-polls, the withdrawal is not refused.
        poll(lambda: client.delete(f"/v1/parking/{parked}").status_code in (204, 404), 30)
    return result


def busy_keep_alive(target: Target, work: Path) -> Result:
    """300 keep-alive connections of one allowed user, past the cap of 256, each asking
    /health again as soon as it is answered and made again as soon as the daemon closes it,
    for 15 s: /health never counts against a caller, so they can keep every connection and
    every probe room busy. Meanwhile new connections ask /health and /ready every 50 ms: held
    counts those answered 200."""
    return _probed_flood(
        target, {"health_polls": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 300)}
    )


def _probed_flood(target: Target, kinds: dict[str, tuple[bytes, int]]) -> Result:
    """:func:`attackers.connection_flood` of ``kinds`` for 15 s while fresh connections ask
    /health and /ready: how many were asked and answered 200."""
    with FreshProbe(target.url) as health, FreshProbe(target.url, "/ready") as ready:
        seen = attackers.connection_flood(target.daemon.port, kinds, 15.0)
    asked = health.asked + ready.asked
    failures = sorted(set(health.failures + ready.failures))[:2]
    how = f"fresh probes answered; flood saw {seen}" + (
        f"; failures {failures}" if failures else ""
    )
    return asked, health.answered + ready.answered, how

"""Connections shared fairly: an allowed caller's requests in the daemon's hands (long-polls,
bodies still arriving) stop at its share, well below the connection cap, and ``/health`` and
``/ready`` always have room, however many long-polls, unfinished requests and silent
connections one allowed user holds."""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.daemon_process import DaemonProcess, start_daemon
from harness.hostile import attackers
from harness.hostile.probe import FreshProbe, HealthProbe
from harness.hostile.sockets import connect, read_all
from harness.waiting import wait_for
from service.api.front.limits import PROBE_ROOM
from tests.hostile.conftest import LIMITS, Hostile

CAP = int(LIMITS["WEIGHT_CACHE_MAX_CONNECTIONS"])
SHARE = CAP // 4  # the default share: a quarter of the connections
HEADERS_ONLY = attackers.CHUNKED_POST + b"\r\n"  # in the daemon's hands, its body to come


def _answer(s: socket.socket) -> dict[str, object]:
    """The problem document the daemon closed ``s`` with."""
    data = read_all(s)
    assert data.startswith(b"HTTP/1.1 "), data[:200]
    document: dict[str, object] = json.loads(data.partition(b"\r\n\r\n")[2])
    return document


def _held(s: socket.socket) -> bool:
    """Whether the daemon holds ``s`` without having answered or closed it."""
    timeout = s.gettimeout()
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.settimeout(timeout)
    return False


def _open(port: int, head: bytes, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = connect(port, timeout_s=5)
        s.sendall(head)
        socks.append(s)
    return socks


@pytest.fixture
def parked(hostile: Hostile) -> Iterator[str]:
    """An engine of this process parked on the model: what its long-polls ask about. Withdrawn
    once the daemon has let go of the test's long-polls (until then the caller is at its share,
    and the withdrawal itself is refused 429)."""
    body = {"model": "tiny", "tp_rank": 0, "tp_size": 1, "client_pid": os.getpid()}
    r = hostile.client.post("/v1/parking", json={**body, "group": uuid.uuid4().hex[:12]})
    assert r.status_code == 201, r.text
    yield r.json()["id"]
    path = f"/v1/parking/{r.json()['id']}"
    wait_for(lambda: hostile.client.delete(path).status_code in (204, 404), 30)


def test_unfinished_requests_of_one_caller_stop_at_its_share(hostile: Hostile) -> None:
    """Twice its share of chunked POSTs that send only their headers: one share is held (their
    bodies may yet come, until the request timeout: 408), the other answered 429
    ``too_many_open_requests`` at once; then the caller is served again."""
    socks = _open(hostile.port, HEADERS_ONLY, 2 * SHARE)
    try:
        answers = [_answer(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    codes = [a["code"] for a in answers]
    assert codes.count("too_many_open_requests") == SHARE, codes
    assert codes.count("request_timeout") == SHARE, codes
    assert {a["limit"] for a in answers if a["code"] == "too_many_open_requests"} == {SHARE}
    assert hostile.client.get("/v1/models").status_code == 200


def test_long_polls_of_one_caller_stop_at_its_share(hostile: Hostile, parked: str) -> None:
    """Long-polls on its own parked engine: its share wait, the rest are refused 429, and a
    new connection's /health and /ready are answered meanwhile."""
    poll = f"GET /v1/parking/{parked}?wait_s=60 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    socks = _open(hostile.port, poll, SHARE + 4)
    try:
        wait_for(lambda: sum(not _held(s) for s in socks) >= 4, 10)
        assert sum(_held(s) for s in socks) == SHARE
        for s in socks:
            if not _held(s):
                assert _answer(s)["code"] == "too_many_open_requests"
        for path in ("/health", "/ready"):
            assert httpx.get(f"{hostile.url}{path}", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()


def test_a_thousand_connections_of_one_allowed_user_leave_probes_room(
    hostile: Hostile, parked: str
) -> None:
    """1,000 connections of the daemon's own user for 6 s: 300 long-polls, 300 chunked POSTs
    that send only their headers, 400 that send nothing, each made again as soon as the daemon
    closes it (260 long-polls made every new connection, /health included, answer 503 for
    60 s). New connections ask /health and /ready throughout: every one is answered 200, as
    is a monitoring client's kept-alive /health."""
    poll = f"GET /v1/parking/{parked}?wait_s=60 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    kinds = {"long_poll": (poll, 300), "headers_only": (HEADERS_ONLY, 300), "silent": (b"", 400)}
    with (
        HealthProbe(hostile.url) as kept,
        FreshProbe(hostile.url) as health,
        FreshProbe(hostile.url, "/ready") as ready,
    ):
        seen = attackers.connection_flood(hostile.port, kinds, 6.0)
    assert seen["long_poll"].get("429", 0) > 0, seen  # past its share, refused
    assert seen["silent"]["made"] > 400, seen  # idle ones made way, again and again
    assert health.asked > 10 and not health.failures, health.failures[:3]
    assert ready.asked > 10 and not ready.failures, ready.failures[:3]
    kept.assert_answered()


@pytest.fixture
def unshared(tmp_path: Path, tiny_fp8: Path) -> Iterator[DaemonProcess]:
    """A daemon whose one caller may hold every connection (its share raised past the cap),
    and long enough (its request timeout 30 s) for the test to see them all held."""
    env = {
        **LIMITS,
        "WEIGHT_CACHE_MAX_REQUESTS_PER_CALLER": str(4 * CAP),
        "WEIGHT_CACHE_REQUEST_TIMEOUT_S": "30",
    }
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", env=env)
    yield daemon
    daemon.stop()


def test_connections_all_busy_leave_room_for_probes_alone(unshared: DaemonProcess) -> None:
    """Every connection has a request in the daemon's hands (none idle to make way): 16 more
    are let in for /health and /ready, which are answered, and for nothing else: a request
    for more is answered 503 ``too_many_connections``, or its connection, idle, makes way for
    a newer one."""
    port = unshared.port
    busy = _open(port, HEADERS_ONLY, CAP)
    extra: list[socket.socket] = []
    try:
        wait_for(lambda: all(_held(s) for s in busy), 10)
        extra = _open(port, HEADERS_ONLY, 2 * PROBE_ROOM)
        answers = [read_all(s) for s in extra]
        refused = [a for a in answers if a]
        assert refused and len(refused) + answers.count(b"") == len(extra)
        for answer in refused:
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == "too_many_connections"
        for path in ("/health", "/ready"):
            assert httpx.get(f"{unshared.url}{path}", timeout=5).status_code == 200
        assert all(_held(s) for s in busy)
    finally:
        for s in busy + extra:
            s.close()

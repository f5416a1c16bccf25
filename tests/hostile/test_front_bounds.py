"""The HTTP front's bounds against clients that cheat the framing: trailers after a chunked body,
requests pipelined by the thousand without reading an answer, and idle connections parked at the
connection cap. Each is cut off with little memory spent and ``/health`` answering throughout,
and the daemon's RSS comes back within 50 MB once the case ends."""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import httpx

from harness.hostile import attackers
from harness.hostile.memory import RssBack
from harness.hostile.probe import HealthProbe
from harness.hostile.sockets import connect, send_until_answered
from harness.waiting import wait_for
from service.api.peer import tcp_socket
from tests.hostile.conftest import LIMITS, Hostile

CAP = int(LIMITS["WEIGHT_CACHE_MAX_CONNECTIONS"])


def _let_go(daemon_end: tuple[tuple[str, int], tuple[str, int]]) -> bool:
    """Whether the daemon has closed (or reset) its end of a connection."""
    found = tcp_socket(*daemon_end)
    return found is None or not found.held_open


def _refusals(hostile: Hostile, code: str) -> float:
    for line in hostile.client.get("/metrics").text.splitlines():
        if line.startswith(f'weight_cache_refusals_total{{code="{code}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_chunked_trailers_count_against_the_header_limit(hostile: Hostile) -> None:
    """Trailers after the last chunk are headers too: a 100 MB trailer is refused with 431 once
    it passes --max-header-bytes, as a header would be (the probe sent 900 MB and kept 876 MB)."""
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        sent, answer = send_until_answered(
            hostile.port, attackers.ENDLESS_TRAILER, b"a" * 65536, 100 * 1024 * 1024
        )
    assert sent < 10 * 1024 * 1024  # closed long before the end
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["code"] == "headers_too_large"
    probe.assert_answered()


def test_chunk_extensions_count_against_the_header_limit(hostile: Hostile) -> None:
    """Chunk extensions are framing, not body: a chunk header of megabytes is refused too."""
    head = attackers.CHUNKED_POST + b"\r\n2;ext="
    sent, answer = send_until_answered(hostile.port, head, b"b" * 65536, 50 * 1024 * 1024)
    assert sent < 10 * 1024 * 1024
    assert answer.startswith(b"HTTP/1.1 431 ") or not answer  # the parser may refuse it first


def test_pipelining_without_reading_is_cut_off(hostile: Hostile) -> None:
    """20 clients pipeline GET /health one request per read and never read an answer (the
    probe pinned every slot for 90 s and grew the daemon by 1 GB from 17 MB sent): each
    connection is closed once it runs more requests ahead of its answers than the daemon
    queues, or reset once it idles with its answers unread; memory comes back, and fresh
    clients are served meanwhile."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    cut_off: list[bool] = []

    def flood() -> None:
        s = connect(hostile.port)
        daemon_end = (s.getpeername(), s.getsockname())

        def read_by_daemon() -> bool:
            found = tcp_socket(*daemon_end)
            return found is None or found.receive_queue == 0

        try:
            for _ in range(2000):
                s.sendall(request)
                with contextlib.suppress(AssertionError):  # it may pause reading a while
                    wait_for(read_by_daemon, timeout=1, every=0.001)
        except (BrokenPipeError, ConnectionResetError):
            cut_off.append(True)
        else:  # never too far ahead: its unread answers get it reset once it idles
            try:
                wait_for(lambda: _let_go(daemon_end), timeout=15)
                cut_off.append(True)
            except AssertionError:
                cut_off.append(False)
        s.close()

    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        threads = [threading.Thread(target=flood) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        with httpx.Client(base_url=hostile.url, timeout=5) as fresh:
            assert fresh.get("/health").status_code == 200
    assert cut_off == [True] * 20
    probe.assert_answered()


def test_a_client_that_stops_reading_its_answers_is_cut_off(hostile: Hostile) -> None:
    """A client keeps asking (never more than a few requests ahead) and never reads: once its
    answers back up past the socket, the connection has --request-timeout to drain, then it is
    aborted (counted as request_timeout) and its slot freed."""
    before = _refusals(hostile, "request_timeout")
    s = connect(hostile.port, rcvbuf=2048)
    daemon_end = (s.getpeername(), s.getsockname())

    def sent_by_daemon() -> int:
        found = tcp_socket(*daemon_end)
        return -1 if found is None else found.send_queue

    with HealthProbe(hostile.url) as probe:
        for _ in range(5000):  # until the daemon's answers back up: they stop going out
            target = sent_by_daemon() + 4 * 4000  # four answers of about 4 KB each

            def answered(target: int = target) -> bool:
                return sent_by_daemon() >= target

            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
            try:
                wait_for(answered, 1, every=0.005)
            except AssertionError:
                break
        else:
            raise AssertionError("the daemon's answers never backed up")
        wait_for(lambda: _refusals(hostile, "request_timeout") > before, timeout=20)
        wait_for(lambda: _let_go(daemon_end), timeout=5)  # the daemon's end is gone
    s.close()
    probe.assert_answered()


def test_idle_connections_cannot_lock_others_out(hostile: Hostile) -> None:
    """A neighbour parks idle connections at the cap, some after a request (keep-alive), some
    before sending anything; a newcomer is still served: the longest-idle connection makes
    way for it, as nginx reuses idle keep-alive connections when it runs out."""
    parked: list[socket.socket] = []
    with RssBack(hostile.daemon.process.pid), HealthProbe(hostile.url) as probe:
        try:
            for i in range(CAP + 8):
                s = connect(hostile.port)
                if i % 2:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert s.recv(65536).startswith(b"HTTP/1.1 200")
                parked.append(s)
            for _ in range(3):
                with httpx.Client(base_url=hostile.url, timeout=5) as newcomer:
                    assert newcomer.get("/health").status_code == 200
        finally:
            for s in parked:
                s.close()
    probe.assert_answered()

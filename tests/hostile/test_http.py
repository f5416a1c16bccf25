"""HTTP input, slow clients and oversized clients: each is refused with a problem document and
its code, and ``/health`` keeps answering throughout."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

from harness.hostile.probe import HealthProbe
from harness.hostile.sockets import read_all
from tests.hostile.conftest import Hostile


def _connect(hostile: Hostile) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", hostile.port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return s


def _answer(s: socket.socket) -> tuple[int, dict]:
    """Status and problem body of what the daemon wrote before closing; status 0 when it
    closed without a word (a connection that made way before sending anything). Raises
    ``TimeoutError`` when the daemon neither answered nor closed within the socket's timeout."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            if data:
                break
            raise
        if not chunk:
            break
        data += chunk
    if not data:
        return 0, {}
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


def test_one_huge_header_is_refused_early(hostile: Hostile) -> None:
    with HealthProbe(hostile.url) as probe:
        s = _connect(hostile)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 100 * 1024 * 1024:  # what the hostile run sent; refused long before
                s.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, body = _answer(s)
        s.close()
    assert status == 431 and body["code"] == "headers_too_large"
    assert sent < 10 * 1024 * 1024  # the connection was closed, not read to the end
    probe.assert_answered()


def test_many_headers_in_parallel(hostile: Hostile) -> None:
    results: list[int] = []

    def flood() -> None:
        s = _connect(hostile)
        try:
            s.sendall(b"GET / HTTP/1.1\r\n")
            for i in range(100_000):
                s.sendall(f"X-{i}: {'b' * 100}\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass
        results.append(_answer(s)[0])
        s.close()

    with HealthProbe(hostile.url) as probe:
        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert results == [431] * 4
    probe.assert_answered()


def test_slowloris_headers_time_out(hostile: Hostile) -> None:
    with HealthProbe(hostile.url) as probe:
        socks = [_connect(hostile) for _ in range(20)]
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        for i in range(5):  # trickling bytes does not extend the deadline
            for s in socks:
                with contextlib.suppress(OSError):
                    s.sendall(f"X-{i}: 1\r\n".encode())
            time.sleep(0.1)
        answers = [_answer(s) for s in socks]
        for s in socks:
            s.close()
    assert {status for status, _ in answers} == {408}
    assert answers[0][1]["code"] == "request_timeout"
    probe.assert_answered()


def test_slow_body_times_out(hostile: Hostile) -> None:
    with HealthProbe(hostile.url) as probe:
        s = _connect(hostile)
        s.sendall(
            b"POST /v1/leases HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 200\r\n\r\n{"model":'
        )
        status, body = _answer(s)
        s.close()
    assert status == 408 and body["code"] == "request_timeout"
    probe.assert_answered()


def test_connections_beyond_the_cap_make_the_idle_ones_way(hostile: Hostile) -> None:
    """60 connections that send nothing against a cap of 32: each new one is let in and the
    oldest of them is closed for it, so the newest are served and the oldest closed
    at once (not after the request timeout)."""
    with HealthProbe(hostile.url) as probe:
        socks = [_connect(hostile) for _ in range(60)]
        for s in socks[:20]:  # among the oldest: closed to make way, nothing written
            s.settimeout(0.5)  # well before the 1 s request timeout would close them
            assert s.recv(4096) == b""
        for s in socks[-20:]:  # the newest are served
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        for s in socks:
            s.close()
    probe.assert_answered()


def _get_health(s: socket.socket) -> bytes:
    """One keep-alive ``GET /health`` on ``s``: the whole answer's bytes (b"" once closed)."""
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_client_between_requests_is_the_last_to_make_way(hostile: Hostile) -> None:
    """At the cap, connections that have not finished a request make way before a keep-alive
    connection between requests (closing that one could race a request its client is sending):
    the answered client, the oldest connection of all, keeps its connection through 60
    newcomers against a cap of 32, half of which sent part of a request."""
    kept = _connect(hostile)
    assert _get_health(kept).startswith(b"HTTP/1.1 200")
    newcomers = [_connect(hostile) for _ in range(60)]
    for s in newcomers[::2]:
        s.sendall(b"GET /he")
    newest = newcomers[-1]
    assert _get_health(newest).startswith(b"HTTP/1.1 200")  # all 60 were let in, in turn
    assert _get_health(kept).startswith(b"HTTP/1.1 200")
    newcomers[1].settimeout(0.5)  # an old newcomer made way, well before its deadline
    assert newcomers[1].recv(4096) == b""
    for s in [kept, *newcomers]:
        s.close()


def test_idle_connections_do_not_pile_up(hostile: Hostile) -> None:
    """Half-open connections are closed by the request deadline, so a client that opens them
    in a loop never holds more than the cap, and file descriptors stay bounded."""
    with HealthProbe(hostile.url) as probe:
        closed = 0
        for _ in range(3):
            socks = [_connect(hostile) for _ in range(40)]
            for s in socks:
                s.sendall(b"GET /")
            for s in socks:
                status, _ = _answer(s)
                closed += status in (0, 408, 503)  # made way, timed out, or made way mid-request
                s.close()
    assert closed == 120
    fds = len(
        list((__import__("pathlib").Path(f"/proc/{hostile.daemon.process.pid}/fd")).iterdir())
    )
    assert fds < 100
    probe.assert_answered()


@pytest.mark.parametrize(
    ("field", "value"),
    [("tp_rank", "0"), ("tp_size", 1.0), ("ttl_s", True), ("client_pid", "1"), ("kernel", 1)],
)
def test_wrong_types_are_not_coerced(hostile: Hostile, field: str, value: object) -> None:
    r = hostile.lease(**{field: value})
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"
    assert r.json()["errors"][0]["loc"][-1] == field


def test_wrong_types_in_renew_and_load(hostile: Hostile) -> None:
    lease = hostile.lease().json()["lease"]["id"]
    r = hostile.client.post(f"/v1/leases/{lease}/renew", json={"ttl_s": "5"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"
    r = hostile.load(hostile.tiny, "typed", tp_size="1")
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"
    assert hostile.client.delete(f"/v1/leases/{lease}").status_code == 204


def test_garbage_and_pipelined_requests(hostile: Hostile) -> None:
    with HealthProbe(hostile.url) as probe:
        s = _connect(hostile)
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 200)  # a TLS hello
        assert _answer(s)[0] == 400
        s.close()
        s = _connect(hostile)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 30 + b"GET /x HTTP/1.1\r\n\r\n")
        s.settimeout(5)
        data = b""
        while data.count(b"HTTP/1.1 ") < 31:
            data += s.recv(65536)
        assert data.count(b"HTTP/1.1 200") == 30 and data.count(b"HTTP/1.1 404") == 1
        s.close()
        # More requests ahead of their answers than the daemon queues: the connection ends.
        s = _connect(hostile)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 100)
        s.settimeout(5)
        assert read_all(s, until_closed=True).count(b"HTTP/1.1 200") < 100
        s.close()
    probe.assert_answered()

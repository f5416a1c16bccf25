"""CPU bounded per byte and per connection on the HTTP front: a body of tiny chunks is refused
after a few of them, whoever sends it, and so are headers of too many lines; nothing of a
request is parsed once an answer has ended it (401, 403, 413: its remaining bytes are dropped,
briefly, then the connection closes); and a peer the daemon refuses, or one without the token,
cannot hold ``/health`` up with 16 connections."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.daemon_process import DaemonProcess, start_daemon
from harness.hostile import attackers
from harness.hostile.probe import HealthProbe
from harness.hostile.sockets import connect, read_all, send_until_answered
from harness.hostile.users import NOBODY, needs_root, run_attacker
from service.api.front.framing import FREE_CHUNKS, MAX_HEADER_LINES, MIN_CHUNK_BYTES
from service.api.front.limits import LINGER_BYTES
from tests.hostile.conftest import LIMITS, Hostile

# What the kernel's buffers on both ends may hold beside what the daemon read: a client is
# cut off within this much, where it could send as long as it liked (77 MB in 8 s).
BUFFERED = 12 << 20
TOKEN = "a-token-the-attacker-lacks-0123456789"
ENDED = {"400", "401", "403", "413", "429", "431"}  # answers that end a request early


def _document(answer: bytes) -> dict[str, Any]:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    document: dict[str, Any] = json.loads(answer.partition(b"\r\n\r\n")[2])
    return document


def test_a_body_of_one_byte_chunks_is_refused_after_a_few(hostile: Hostile) -> None:
    """One byte of body per chunk, five of framing (one connection kept a core busy and
    /health at p50 593 ms): refused 400 ``chunks_too_small`` once past the free chunks."""
    with HealthProbe(hostile.url) as probe:
        head = attackers.CHUNKED_POST + b"\r\n"
        sent, answer = send_until_answered(
            hostile.port, head, attackers.TINY_CHUNK * 100, 100 << 20
        )
    document = _document(answer)
    assert document["code"] == "chunks_too_small"
    assert document["chunks"] > FREE_CHUNKS
    assert sent < BUFFERED
    probe.assert_answered()


def test_chunks_that_carry_their_framing_are_served(hostile: Hostile) -> None:
    """A body in chunks of the minimum average size reaches the route (here, to be judged on
    its JSON), as an honest streaming client's does."""
    body = json.dumps({"model": "tiny", "pad": " " * (40 * MIN_CHUNK_BYTES)}).encode()
    pieces = [body[i : i + MIN_CHUNK_BYTES] for i in range(0, len(body), MIN_CHUNK_BYTES)]
    r = hostile.client.post(
        "/v1/leases", content=iter(pieces), headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["code"] == "invalid_request"  # the route judged it


def test_too_many_header_lines_are_refused(hostile: Hostile) -> None:
    """Each header line is a call into Python: past the bound, 431 however short they are."""
    lines = b"".join(b"a%d: b\r\n" % i for i in range(MAX_HEADER_LINES + 1))
    s = connect(hostile.port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    document = _document(read_all(s))
    s.close()
    assert document["code"] == "headers_too_large" and document["limit"] == MAX_HEADER_LINES


def test_nothing_is_parsed_after_a_413(hostile: Hostile) -> None:
    """A body declared larger than the limit is answered 413 before it comes; what the client
    still sends is dropped, at most ``LINGER_BYTES`` of it, and the connection closed."""
    head = attackers.LEASE_POST + b"content-length: 1000000000\r\n\r\n"
    sent, answer = send_until_answered(hostile.port, head, b" " * 65536, 500 << 20)
    assert _document(answer)["code"] == "payload_too_large"
    assert sent < LINGER_BYTES + BUFFERED


@needs_root
def test_nothing_is_parsed_after_a_403(hostile: Hostile) -> None:
    """A user the daemon refuses over TCP sends a chunked body of honest chunks: 403, and its
    connection is closed within a few megabytes, each time (it was read until the request
    timeout)."""
    seen = run_attacker(
        NOBODY,
        "chunked_posts",
        port=hostile.port,
        connections=1,
        seconds=2.0,
        chunk=attackers.PAID_CHUNK,
    )
    assert set(seen["statuses"]) == {"403"}, seen
    assert seen["bytes"] / seen["requests"] < LINGER_BYTES + BUFFERED


@pytest.fixture(scope="module")
def with_token(tmp_path_factory: pytest.TempPathFactory, tiny_fp8: Path) -> Iterator[DaemonProcess]:
    daemon = start_daemon(
        tmp_path_factory.mktemp("token"),
        [tiny_fp8],
        "--model-id",
        "tiny",
        env={**LIMITS, "WEIGHT_CACHE_TOKEN": TOKEN},
    )
    yield daemon
    daemon.stop()


def test_nothing_is_parsed_after_a_401(with_token: DaemonProcess) -> None:
    seen = attackers.chunked_posts(with_token.port, 1, 2.0, chunk=attackers.PAID_CHUNK)
    assert set(seen["statuses"]) == {"401"}, seen
    assert seen["bytes"] / seen["requests"] < LINGER_BYTES + BUFFERED


def test_16_connections_without_the_token_leave_health_answering(
    with_token: DaemonProcess,
) -> None:
    """16 connections without the token send bodies of one-byte chunks, each again on a new
    connection once closed (four held /health up to 5 s): each request is ended at once."""
    with HealthProbe(with_token.url) as probe:
        seen = attackers.chunked_posts(with_token.port, 16, 4.0)
    assert seen["requests"] > 16 and set(seen["statuses"]) <= ENDED, seen
    probe.assert_answered()
    assert httpx.get(f"{with_token.url}/health").status_code == 200


@needs_root
def test_16_connections_of_a_refused_user_leave_health_answering(hostile: Hostile) -> None:
    """The same from a user the daemon refuses over TCP (403 ``peer_not_allowed``)."""
    with HealthProbe(hostile.url) as probe:
        seen = run_attacker(NOBODY, "chunked_posts", port=hostile.port, connections=16, seconds=4.0)
    assert seen["requests"] > 16 and set(seen["statuses"]) <= ENDED, seen
    probe.assert_answered()

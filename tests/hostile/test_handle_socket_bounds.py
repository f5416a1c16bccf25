"""The handle socket bounds the whole exchange: a request must come whole within its deadline
however slowly its bytes trickle, one user holds at most its share of the connections, and the
rightful lease holder is answered while a member of the socket's group trickles bytes into
many (70 such connections, a byte every 4 s, kept the holder out for 40 s)."""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.daemon_process import DaemonProcess, start_daemon
from harness.hostile.handle_holder import holder_under_trickle
from harness.hostile.users import NOBODY, needs_root
from protocol.errors import HandleRefusedError
from protocol.fd_passing import receive_message
from protocol.handle_socket import HandleAnswer
from service.registry.handle_server import PER_PEER, REQUEST_S, HandleServer
from service.registry.leases import Lease


def _no_lease(lease: str, arena: int) -> tuple[Lease, int, int]:
    raise HandleRefusedError(f"no lease {lease}")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HandleServer]:
    handles = HandleServer(tmp_path / "handles.sock", _no_lease)
    handles.start()
    yield handles
    handles.stop()


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(path))
    return s


def _refusal(s: socket.socket) -> str:
    got = receive_message(s, HandleAnswer, 1 << 16)
    assert got is not None and got[0].problem is not None
    return str(got[0].problem["why"])


def test_a_trickled_request_is_cut_off_at_its_deadline(server: HandleServer) -> None:
    """One byte at a time, each well within any per-read timeout: refused (why ``timeout``)
    once the request has had its ``REQUEST_S`` to come whole."""
    s = _connect(server.path)
    request = b"\x00\x00\x00\x40" + b"{" + b" " * 62 + b"}"
    sent = 0
    try:
        while sent < len(request):
            s.send(request[sent : sent + 1])
            sent += 1
            time.sleep(REQUEST_S / 8)
    except OSError:
        pass  # closed on us, as it should be
    assert sent < len(request)
    assert _refusal(s) == "timeout"
    s.close()


def test_one_user_holds_at_most_its_share_of_connections(server: HandleServer) -> None:
    """``PER_PEER`` connections of one user that send nothing: one more is refused at once
    (why ``busy``); once one of them ends, the user is served again."""
    held = [_connect(server.path) for _ in range(PER_PEER)]
    try:
        extra = _connect(server.path)
        assert _refusal(extra) == "busy"
        extra.close()
        held.pop().close()

        def served() -> str:
            late = _connect(server.path)
            late.sendall(b"\x00\x00\x00\x02{}")
            try:
                return _refusal(late)
            finally:
                late.close()

        deadline = time.monotonic() + 10
        while (why := served()) == "busy" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert why == "malformed"  # read and judged: its slot was there
    finally:
        for s in held:
            s.close()


@pytest.fixture
def grouped(tmp_path: Path, tiny_fp8: Path) -> Iterator[DaemonProcess]:
    """A daemon whose run directory and handle socket are open to nobody's group."""
    reachable = Path(tempfile.mkdtemp(prefix="wc-handles-"))
    reachable.chmod(0o755)
    daemon = start_daemon(
        tmp_path,
        [tiny_fp8],
        "--model-id",
        "tiny",
        "--shm-group",
        str(NOBODY),
        run_dir=reachable / "run",
    )
    yield daemon
    daemon.stop()
    shutil.rmtree(reachable, ignore_errors=True)


@needs_root
def test_the_holder_is_answered_while_a_group_member_trickles(grouped: DaemonProcess) -> None:
    seen = holder_under_trickle(grouped.url, "tiny", connections=70, seconds=6.0, every_s=1.0)
    assert seen.asked > 10 and seen.answered == seen.asked, seen.errors
    assert seen.attacker.get("made", 0) > 0, seen.attacker  # it reached the socket
    assert seen.attacker.get("closed", 0) > 0, seen.attacker  # and was cut off, again and again

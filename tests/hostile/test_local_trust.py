"""Local trust, stated and enforced: without a token, loopback TCP serves only the daemon's own
user and root; the Unix socket is 0600 (0660 for ``--socket-group``), proves its peer by
``SO_PEERCRED`` and goes away with the daemon; a token file others may read, a token no header
can carry, and an unsafe shared-memory directory each stop the daemon in one line."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from harness.cli import run_cli
from harness.daemon_process import lease_body, start_daemon
from harness.hostile.users import NOBODY, UserAgent, needs_root, run_as
from harness.waiting import wait_for
from service.memory.shm import arena_dir_path
from weight_cache_cli import cli


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can reach, for sockets other users are to find (or not)."""
    path = Path(tempfile.mkdtemp(prefix="wc-trust-", dir="/dev/shm"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_without_a_token_loopback_tcp_serves_only_the_daemons_user(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny")
    try:
        with UserAgent(daemon.url, NOBODY) as neighbour:
            assert neighbour.request("GET", "/health")[0] == 200  # liveness stays open
            for method, path in (("GET", "/v1/inventory"), ("POST", "/v1/leases")):
                status, body = neighbour.request(method, path, lease_body())
                assert status == 403 and body["code"] == "peer_not_allowed", body
                assert f"uid {NOBODY}" in body["detail"]
        assert httpx.get(f"{daemon.url}/v1/inventory").status_code == 200  # the daemon's user
    finally:
        daemon.stop()


@needs_root
def test_the_token_lets_any_user_in_and_is_checked_before_the_body(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    token = "s3cret-token-0123456789"
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", env={"WEIGHT_CACHE_TOKEN": token}
    )
    try:
        with UserAgent(daemon.url, NOBODY) as user:
            auth = {"authorization": f"Bearer {token}"}
            assert user.request("GET", "/v1/inventory", headers=auth)[0] == 200
            status, body = user.request("GET", "/v1/inventory")
            assert status == 401 and body["code"] == "unauthorized"
        # Bad JSON without the token: 401, not the 422 a parsed body would give.
        r = httpx.post(
            f"{daemon.url}/v1/leases",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    finally:
        daemon.stop()


@needs_root
def test_the_unix_socket_is_the_owners_and_goes_with_the_daemon(
    tmp_path: Path, tiny_fp8: Path, open_dir: Path
) -> None:
    sock = open_dir / "api.sock"
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", uds=sock)
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        code = (
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1]); print('connected')\n"
            "except PermissionError:\n    print('denied')\n"
        )
        assert run_as(NOBODY, NOBODY, code, str(sock)) == "denied"
    finally:
        daemon.stop()
    assert not sock.exists()  # removed at shutdown


@needs_root
def test_a_socket_group_may_use_the_socket_as_itself(
    tmp_path: Path, tiny_fp8: Path, open_dir: Path
) -> None:
    """0660 for --socket-group; a member leases as itself, proven by SO_PEERCRED: its uid and
    process are the lease's holder, and the lease ends with that process."""
    sock = open_dir / "api.sock"
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", "--socket-group", "nogroup", uds=sock
    )
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        assert sock.stat().st_gid == NOBODY
        with UserAgent("http://weight-cache", NOBODY, uds=str(sock)) as member:
            # A client_pid it cannot see: the kernel's word for the caller's process is used.
            status, body = member.request(
                "POST", "/v1/leases", lease_body(client_pid=4_000_000, ttl_s=600)
            )
            assert status == 201, body
            lease = body["lease"]
            assert (lease["holder_uid"], lease["holder_pid"]) == (NOBODY, member.pid)
            assert lease["pid_watched"]
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://weight-cache") as owner:
            wait_for(lambda: owner.get("/v1/leases").json() == [], timeout=10)  # reaped
    finally:
        daemon.stop()
    assert not sock.exists()


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_peer_in_another_pid_namespace_holds_by_uid(
    tmp_path: Path, tiny_fp8: Path, open_dir: Path
) -> None:
    """A daemon in a PID namespace of its own sees its Unix-socket peers as pid 0: the lease is
    held by the peer's uid, unwatched (its TTL ends it), whatever client_pid says."""
    sock = open_dir / "api.sock"
    log = tmp_path / "daemon.log"
    shm = tmp_path / "shm"
    shm.mkdir()
    args = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",  # should the test die, the daemon goes with unshare
        sys.executable,
        "-m",
        "weight_cache_cli",
        "serve",
        "--uds",
        str(sock),
        "--model",
        str(tiny_fp8),
        "--model-id",
        "tiny",
        "--device",
        "cpu",
        "--shm-dir",
        str(shm),
    ]
    env = {**os.environ, "WEIGHT_CACHE_CACHE_DIR": str(tmp_path / "cache")}
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    transport = httpx.HTTPTransport(uds=str(sock))
    client = httpx.Client(transport=transport, base_url="http://weight-cache", timeout=5)

    def ready() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            return client.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout=60)
        r = client.post("/v1/leases", json=lease_body(ttl_s=60))
        assert r.status_code == 201, r.text
        lease = r.json()["lease"]
        assert lease["holder_uid"] == 0 and lease["holder_pid"] is None
        assert not lease["pid_watched"]
    finally:
        client.close()
        # unshare waits for its child, ignoring SIGTERM: the daemon itself is told to stop.
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        for child in children:
            os.kill(int(child), signal.SIGTERM)
        process.wait(30)


def test_a_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    token.chmod(0o644)
    result = CliRunner().invoke(
        cli,
        ["serve", "--shm-dir", str(tmp_path), "--device", "cpu", "--token-file", str(token)],
        env={"WEIGHT_CACHE_CACHE_DIR": str(tmp_path)},
    )
    assert result.exit_code == 2
    assert "readable by every user (mode 0644)" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_non_ascii_token_is_one_line_on_both_sides(tmp_path: Path) -> None:
    """It crashed the client with UnicodeEncodeError; now the daemon refuses it at start and
    the client says what is wrong with it, each in one line."""
    env = {
        "WEIGHT_CACHE_TOKEN": "t\u00f6ken-0123456789abcdef",
        "WEIGHT_CACHE_CACHE_DIR": str(tmp_path),
    }
    served = CliRunner().invoke(
        cli, ["serve", "--shm-dir", str(tmp_path), "--device", "cpu"], env=env
    )
    assert served.exit_code == 2 and "visible ASCII" in served.output
    status = run_cli("status", "--url", "http://127.0.0.1:9", env=env, timeout=60)
    assert status.returncode == 1
    assert "[unauthorized]" in status.stderr and "visible ASCII" in status.stderr
    assert "Traceback" not in status.stderr


@needs_root
def test_an_unsafe_shm_dir_is_one_line(tmp_path: Path) -> None:
    """Refusing a shared-memory directory another user planted exited 3 with a traceback."""
    root = tmp_path / "shm"
    planted = arena_dir_path(root)
    planted.mkdir(parents=True, mode=0o777)
    os.chown(planted, NOBODY, NOBODY)
    env = {"WEIGHT_CACHE_CACHE_DIR": str(tmp_path), "WEIGHT_CACHE_DEVICE": "cpu"}
    out = run_cli("serve", "--shm-dir", str(root), env=env, timeout=60)
    assert out.returncode == 2
    assert "belongs to uid 65534" in out.stderr
    assert "Traceback" not in out.stderr
    lines = [x for x in out.stderr.splitlines() if "Error" in x or "error" in x]
    assert len(lines) == 1, out.stderr


def test_the_socket_file_of_another_daemon_is_left_alone(tmp_path: Path, tiny_fp8: Path) -> None:
    """Shutdown removes its socket only if the file is still the one it made."""
    sock = tmp_path / "api.sock"
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", uds=sock)
    moved = tmp_path / "moved.sock"
    sock.rename(moved)
    replacement = socket.socket(socket.AF_UNIX)
    replacement.bind(str(sock))  # another daemon's socket, made meanwhile
    try:
        daemon.stop()
        assert sock.exists() and stat.S_ISSOCK(sock.stat().st_mode)
    finally:
        replacement.close()

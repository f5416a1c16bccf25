"""The handle socket with a real daemon process and real peers: the lease's holder gets the
arena's descriptor (read-only); anyone else gets a typed refusal and the daemon loses nothing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.daemon_process import DaemonProcess, lease_body, start_daemon
from harness.hostile.handle_holder import present_elsewhere
from protocol.errors import HandleRefusedError
from protocol.fd_passing import receive_message
from protocol.handle_socket import HandleAnswer, fetch_arena_fd
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import HandleAccess, ShmHandle
from service.run_dir import HANDLE_SOCKET


def grant(daemon: DaemonProcess, **over: Any) -> LeaseGrant:
    r = httpx.post(f"{daemon.url}/v1/leases", json=lease_body(**over))
    assert r.status_code == 201, r.text
    return LeaseGrant.model_validate_json(r.content)


def access_of(g: LeaseGrant) -> HandleAccess:
    handle = g.arenas[0].handle
    assert isinstance(handle, ShmHandle) and handle.access is not None
    return handle.access


def present(g: LeaseGrant, prefix: list[str] | None = None) -> dict[str, object]:
    return present_elsewhere(access_of(g), g.lease.id, prefix)


def test_the_holder_gets_a_read_only_descriptor(daemon_process: DaemonProcess) -> None:
    g = grant(daemon_process)  # this process holds it
    access = access_of(g)
    assert access.socket == str(daemon_process.run_dir / HANDLE_SOCKET)
    fd, size = fetch_arena_fd(access, g.lease.id, 0)
    try:
        assert size == g.arenas[0].nbytes == os.fstat(fd).st_size
        assert os.readlink(f"/proc/self/fd/{fd}").startswith(str(daemon_process.shm_dir))
        flags = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        assert flags & os.O_ACCMODE == os.O_RDONLY  # an engine cannot map it writable
    finally:
        os.close(fd)


def test_another_process_with_the_secret_is_refused(daemon_process: DaemonProcess) -> None:
    """A neighbour that learnt a lease's id and secret is not its holder: refused, typed."""
    answer = present(grant(daemon_process))
    assert answer["code"] == "handle_refused" and answer["reason"] == "handle_refused"
    assert "is not the lease's holder" in str(answer["why"])


def test_a_wrong_secret_or_an_ended_lease_is_refused(daemon_process: DaemonProcess) -> None:
    g = grant(daemon_process)
    access = access_of(g)
    with pytest.raises(HandleRefusedError) as err:
        fetch_arena_fd(access.model_copy(update={"secret": "x" * 24}), g.lease.id, 0)
    assert err.value.extra["why"] == "the secret is not this lease's"
    with pytest.raises(HandleRefusedError) as err:
        fetch_arena_fd(access, g.lease.id, 3)  # no such arena
    assert httpx.delete(f"{daemon_process.url}/v1/leases/{g.lease.id}").status_code == 204
    with pytest.raises(HandleRefusedError) as err:
        fetch_arena_fd(access, g.lease.id, 0)
    assert err.value.extra["why"] == "lease_not_found"
    # Still serving: a new lease's holder gets its descriptor.
    again = grant(daemon_process)
    fd, _ = fetch_arena_fd(access_of(again), again.lease.id, 0)
    os.close(fd)
    metrics = httpx.get(f"{daemon_process.url}/metrics").text
    assert 'weight_cache_refusals_total{code="handle_refused"} 3.0' in metrics


def test_another_user_is_refused_even_where_the_socket_is_reachable(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    """With the run directory opened to everyone (a misconfiguration), the peer's uid is still
    checked: a process of another user, holding the lease's secret, is refused."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run a child as another user")
    run = Path(tempfile.mkdtemp(prefix="wc-open-run-"))  # under /tmp, reachable by all
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", run_dir=run)
    try:
        g = grant(daemon, client_pid=1)  # whoever it names, the uid check comes first
        os.chmod(run, 0o755)
        os.chmod(run / HANDLE_SOCKET, 0o777)
        nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        answer = present(g, nobody)
    finally:
        daemon.stop()
        shutil.rmtree(run, ignore_errors=True)
    assert answer["code"] == "handle_refused"
    assert "uid 65534 is not the lease holder's (uid 0), the daemon's user or root" in str(
        answer["why"]
    )


def test_garbage_on_the_socket_changes_nothing(daemon_process: DaemonProcess) -> None:
    path = str(daemon_process.run_dir / HANDLE_SOCKET)
    for payload in (b"\x00\x00\x00\x05hello", b"\xff\xff\xff\xff", b"GET / HTTP/1.1\r\n\r\n", b""):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            got = receive_message(sock, HandleAnswer, 1 << 16)
            if payload:  # a refusal, typed; nothing at all for an empty request
                assert got is not None and not got[1]
                assert got[0].problem is not None and got[0].problem["code"] == "handle_refused"
            else:
                assert got is None
    assert httpx.get(f"{daemon_process.url}/v1/models/tiny").json()["state"] == "ready"
    again = grant(daemon_process)
    fd, _ = fetch_arena_fd(access_of(again), again.lease.id, 0)
    os.close(fd)


NAMESPACED = """
import json, os, sys, torch
from pathlib import Path
from engine_client.attach import attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
expect = Expectations.for_checkpoint(Path(sys.argv[2]), torch.device("cpu"))
with attach("tiny", expect, config=ClientConfig(url=sys.argv[1]), keep_alive=False) as att:
    print(json.dumps({"pid": os.getpid(), "via": att.arena.via, "zero_copy": att.zero_copy(),
                      "lease": att.lease_id}))
"""


def test_an_engine_in_its_own_pid_namespace_gets_the_descriptor(
    daemon_process: DaemonProcess, tiny_fp8: Path
) -> None:
    """An engine whose PID namespace is not the daemon's (as in a container of its own) names
    itself by its own pid; the daemon sees it by another and relates the two (NSpid)."""
    unshare = shutil.which("unshare")
    probe = subprocess.run(
        [unshare or "unshare", "--pid", "--fork", "--mount-proc", "true"],
        capture_output=True,
        check=False,
    )
    if unshare is None or probe.returncode != 0:
        pytest.skip("cannot make a PID namespace here")
    out = subprocess.run(
        [
            *(unshare, "--pid", "--fork", "--mount-proc"),
            *(sys.executable, "-c", NAMESPACED, daemon_process.url, str(tiny_fp8)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["pid"] == 1 and seen["via"] == "descriptor" and seen["zero_copy"]
    # Released on close, from inside its namespace.
    assert httpx.get(f"{daemon_process.url}/v1/leases/{seen['lease']}").status_code == 404

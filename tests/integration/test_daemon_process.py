"""A real daemon process and a real second process: bytes through shared memory, read-only
mappings, reaping a SIGKILLed client, clean shutdown."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from harness.daemon_process import DaemonProcess, lease_body, start_daemon
from harness.waiting import wait_for
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.checksum import storage_checksum

CHILD = [sys.executable, "-m", "tests.integration.engine_child"]


def run_child(mode: str, url: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``engine_child`` in ``mode`` against model ``tiny`` at ``url``."""
    return subprocess.run(
        [*CHILD, mode, url, "tiny"], capture_output=True, text=True, timeout=120, check=check
    )


def ordinary_checksums(checkpoint: Path) -> dict[str, str]:
    """Every processed tensor's checksum from an ordinary load of ``checkpoint``."""
    with Checkpoint.open(checkpoint) as ckpt:
        plan = plan_model(ckpt)
        loaded = process_checkpoint(ckpt, plan)
    return {s.name: storage_checksum(s.storage_of(loaded[s.name])) for s in plan.specs}


def test_second_process_reads_the_processed_bytes(
    daemon_process: DaemonProcess, tiny_fp8: Path
) -> None:
    seen = json.loads(run_child("read", daemon_process.url).stdout)["tensors"]
    with Checkpoint.open(tiny_fp8) as ckpt:
        expected = process_checkpoint(ckpt, plan_model(ckpt))
    checksums = ordinary_checksums(tiny_fp8)
    assert set(seen) == set(expected)
    for name, tensor in expected.items():
        got = seen[name]
        assert got["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert got["shape"] == list(tensor.shape) and got["stride"] == list(tensor.stride())
        assert got["data_ptr_offset"] % 256 == 0
        assert got["checksum"] == checksums[name], name


def test_second_process_cannot_write(daemon_process: DaemonProcess, tiny_fp8: Path) -> None:
    out = run_child("write", daemon_process.url, check=False)
    assert out.returncode == -signal.SIGSEGV, out
    assert "writing" in out.stdout and "wrote" not in out.stdout
    # the daemon's bytes are intact: a fresh reader sees every tensor as an ordinary load has it
    seen = json.loads(run_child("read", daemon_process.url).stdout)["tensors"]
    assert {name: t["checksum"] for name, t in seen.items()} == ordinary_checksums(tiny_fp8)


def test_sigkilled_engine_is_reaped_and_model_stays(daemon_process: DaemonProcess) -> None:
    child = subprocess.Popen(
        [*CHILD, "hold", daemon_process.url, "tiny"], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    lease_id = json.loads(child.stdout.readline())["lease"]
    url = daemon_process.url
    assert [x["id"] for x in httpx.get(f"{url}/v1/leases").json()] == [lease_id]
    files = sorted(daemon_process.shm_dir.iterdir())
    child.send_signal(signal.SIGKILL)
    child.wait()
    wait_for(lambda: httpx.get(f"{url}/v1/leases").json() == [], timeout=10)
    assert httpx.get(f"{url}/v1/leases/{lease_id}").json()["reason"] == "reaped"
    assert httpx.get(f"{url}/v1/models/tiny").json()["state"] == "ready"
    assert sorted(daemon_process.shm_dir.iterdir()) == files  # nothing leaked, nothing lost
    assert httpx.post(f"{url}/v1/leases", json=lease_body(client_pid=1)).status_code == 201


def test_shutdown_removes_arenas(tmp_path: Path, tiny_fp8: Path) -> None:
    daemon = start_daemon(tmp_path, [tiny_fp8])
    try:
        assert len(list(daemon.shm_dir.iterdir())) == 1
    finally:
        daemon.stop(signal.SIGTERM)
    # uvicorn shuts down cleanly, then re-raises the signal it caught
    assert daemon.process.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in daemon.log.read_text()
    assert list(daemon.shm_dir.iterdir()) == []


def test_serves_on_a_unix_socket(tmp_path: Path, tiny_fp8: Path) -> None:
    sock = tmp_path / "wc.sock"
    daemon = start_daemon(tmp_path, [tiny_fp8], uds=sock)
    try:
        with httpx.Client(
            transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://weight-cache"
        ) as client:
            assert client.get("/v1/models").json()[0]["state"] == "ready"
    finally:
        daemon.stop()

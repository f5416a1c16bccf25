"""Faults and floods: bytes changed under a resident model, lease floods against the caps, and
thousands of leases whose client dies, with ``/health`` answering throughout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx

from harness.daemon_process import lease_body, start_daemon
from harness.hostile.probe import HealthProbe
from harness.waiting import wait_for
from tests.hostile.conftest import LIMITS, Hostile


def expired_total(client: httpx.Client) -> float:
    """``weight_cache_leases_expired_total`` as the daemon reports it."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("weight_cache_leases_expired_total "):
            return float(line.split()[1])
    return 0.0


def _expired_beyond(client: httpx.Client, count: float) -> bool:
    return expired_total(client) > count


def sweeps_pass(client: httpx.Client, count: int = 2) -> None:
    """Wait for ``count`` more sweeps of the reaper: each time, a lease with a short TTL that
    nothing reads again ends only when a sweep finds it expired (and that sweep checks every
    client PID too)."""
    for _ in range(count):
        before = expired_total(client)
        assert client.post("/v1/leases", json=lease_body(ttl_s=0.05)).status_code == 201
        wait_for(partial(_expired_beyond, client, before), timeout=30, what="a lease sweep")


def test_a_changed_arena_fails_its_model(hostile: Hostile) -> None:
    path = hostile.checkpoint("scrubbed")
    assert hostile.load(path, "scrubbed").status_code == 202
    assert hostile.settled("scrubbed")["state"] == "ready"
    (arena,) = [p for p in hostile.daemon.shm_dir.iterdir() if "-scrubbed-" in p.name]
    with HealthProbe(hostile.url) as probe:
        with arena.open("r+b") as f:  # a client of the daemon's user writes into the weights
            f.seek(300)
            byte = f.read(1)
            f.seek(300)
            f.write(bytes([byte[0] ^ 0xFF]))
        wait_for(lambda: hostile.settled("scrubbed")["state"] == "failed", timeout=10)
    info = hostile.settled("scrubbed")
    assert info["error"]["code"] == "arena_corrupted"
    r = hostile.lease(model="scrubbed")
    assert r.status_code == 409 and r.json()["code"] == "model_failed"
    assert r.json()["reason"] == "arena_corrupted"
    metrics = hostile.client.get("/metrics").text
    assert 'weight_cache_arena_corruptions_total{model="scrubbed"} 1.0' in metrics
    assert hostile.settled("tiny")["state"] == "ready"  # the others are untouched
    hostile.unload("scrubbed")
    assert not arena.exists()
    probe.assert_answered()


def test_lease_caps_answer_429_with_a_code(hostile: Hostile) -> None:
    per_client = int(LIMITS["WEIGHT_CACHE_MAX_LEASES_PER_CLIENT"])
    total = int(LIMITS["WEIGHT_CACHE_MAX_LEASES"])
    granted = []
    # Live processes of this user to lease for (a PID the daemon cannot see is refused).
    others = [
        subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        for _ in range(total // per_client)
    ]
    try:
        with HealthProbe(hostile.url) as probe:
            for _ in range(per_client):
                r = hostile.lease()
                assert r.status_code == 201
                granted.append(r.json()["lease"]["id"])
            r = hostile.lease()
            assert r.status_code == 429 and r.json()["code"] == "too_many_client_leases"
            assert r.json()["limit"] == per_client
            for other in others:
                while len(granted) < total:
                    r = hostile.lease(client_pid=other.pid)
                    if r.status_code == 429:
                        assert r.json()["code"] == "too_many_client_leases"
                        break
                    assert r.status_code == 201, r.text
                    granted.append(r.json()["lease"]["id"])
            assert len(granted) == total
            r = hostile.lease(client_pid=others[0].pid)
            assert r.status_code == 429 and r.json()["code"] == "too_many_leases"
            for lease in granted:
                assert hostile.client.delete(f"/v1/leases/{lease}").status_code == 204
            r = hostile.lease()
            assert r.status_code == 201
            hostile.client.delete(f"/v1/leases/{r.json()['lease']['id']}")
        probe.assert_answered()
    finally:
        for other in others:
            assert other.stdin is not None
            other.stdin.close()
            other.wait(30)


def test_thousands_of_leases_of_a_dying_client(tmp_path: Path, tiny_fp8: Path) -> None:
    """2,000 leases of one client: the reaper checks that process once per sweep, off the
    event loop, and ends them all once it dies."""
    daemon = start_daemon(
        tmp_path,
        [tiny_fp8],
        "--model-id",
        "tiny",
        "--max-leases",
        "100000",
        "--max-leases-per-client",
        "100000",
        "--max-leases-per-uid",
        "100000",
    )
    client_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with HealthProbe(daemon.url) as probe, httpx.Client(base_url=daemon.url) as client:
            for _ in range(2_000):
                r = client.post("/v1/leases", json=lease_body(client_pid=client_process.pid))
                assert r.status_code == 201
            sweeps_pass(client)  # several sweeps over all of them
            inventory = client.get("/v1/inventory").json()
            assert inventory["active_leases"] == 2_000
            client_process.kill()
            client_process.wait(10)
            wait_for(lambda: client.get("/v1/inventory").json()["active_leases"] == 0, 10)
            metrics = client.get("/metrics").text
            assert "weight_cache_leases_reaped_total 2000.0" in metrics
        probe.assert_answered()
    finally:
        if client_process.poll() is None:
            client_process.kill()
        daemon.stop()


def test_expiry_is_exact_under_renewal_churn(tmp_path: Path, tiny_fp8: Path) -> None:
    """Renewed leases stay, unrenewed ones expire, however many heap entries renewals left."""
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny")
    try:
        with httpx.Client(base_url=daemon.url) as client:
            kept = client.post("/v1/leases", json=lease_body(ttl_s=1.0)).json()["lease"]["id"]
            gone = client.post("/v1/leases", json=lease_body(ttl_s=0.3)).json()["lease"]["id"]
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                assert client.post(f"/v1/leases/{kept}/renew").status_code == 200
                time.sleep(0.02)
            assert client.get(f"/v1/leases/{kept}").status_code == 200
            r = client.get(f"/v1/leases/{gone}")
            assert r.status_code == 410 and r.json()["reason"] == "expired"
    finally:
        daemon.stop()


def test_a_live_client_keeps_its_leases_across_sweeps(tmp_path: Path, tiny_fp8: Path) -> None:
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny")
    try:
        with httpx.Client(base_url=daemon.url) as client:
            mine = client.post("/v1/leases", json=lease_body(client_pid=os.getpid()))
            assert mine.status_code == 201
            sweeps_pass(client)  # a live client keeps its lease
            lease = mine.json()["lease"]["id"]
            assert client.get(f"/v1/leases/{lease}").status_code == 200
    finally:
        daemon.stop()

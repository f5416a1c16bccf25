"""Soak: 10,000 lease/renew/release cycles from several client processes against one daemon;
afterwards the daemon's open files, shared-memory files, threads and resident memory are back
where they started."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import httpx
import pytest

from engine_client.client import ClientConfig, DaemonClient
from harness.daemon_process import DaemonProcess, start_daemon
from harness.waiting import wait_for

CYCLES = 10_000
PROCESSES = 4


def _cycles(url: str, count: int, errors: multiprocessing.Queue) -> None:
    failures = 0
    with DaemonClient(ClientConfig(url=url)) as client:
        for _ in range(count):
            try:
                grant = client.lease("tiny", ttl_s=30)
                client.renew(grant.lease.id, ttl_s=60)
                client.release(grant.lease.id)
            except Exception:
                failures += 1
    errors.put(failures)


def footprint(daemon: DaemonProcess) -> dict[str, int]:
    pid = daemon.process.pid
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "shm_files": len(list(daemon.shm_dir.iterdir())),
        "leases": len(httpx.get(f"{daemon.url}/v1/leases").json()),
    }


def held_connections(port: int) -> int:
    """TCP connections on ``port`` that a process still holds open (listening sockets, and
    closed ones left to the kernel with no descriptor, do not count)."""
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] != "0A" and fields[9] != "0":  # 0A: LISTEN
                held += 1
    return held


def settle(daemon: DaemonProcess) -> dict[str, int]:
    """The footprint once the server has closed the keep-alive connections of finished clients."""
    port = int(daemon.url.rsplit(":", 1)[1])
    wait_for(lambda: held_connections(port) == 0, timeout=30)
    return footprint(daemon)


@pytest.mark.slow
def test_soak_leaves_no_trace(tmp_path: Path, tiny_fp8: Path, capsys) -> None:
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny")
    try:
        ctx = multiprocessing.get_context("spawn")
        errors = ctx.Queue()
        warm = ctx.Process(target=_cycles, args=(daemon.url, 300, errors))
        warm.start()
        assert errors.get(timeout=120) == 0
        warm.join(30)
        assert warm.exitcode == 0
        before = settle(daemon)
        start = time.perf_counter()
        procs = [
            ctx.Process(target=_cycles, args=(daemon.url, CYCLES // PROCESSES, errors))
            for _ in range(PROCESSES)
        ]
        for p in procs:
            p.start()
        failures = sum(errors.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0] * PROCESSES
        elapsed = time.perf_counter() - start
        after = settle(daemon)
        # Routes run in worker threads; those the burst added exit after 10 s idle (AnyIO
        # prunes them on its next call, which each footprint's GET /v1/leases makes).
        wait_for(lambda: footprint(daemon)["threads"] <= before["threads"], timeout=60)
        after["threads"] = footprint(daemon)["threads"]
        metrics = httpx.get(f"{daemon.url}/metrics").text
    finally:
        daemon.stop()
    with capsys.disabled():
        print(
            f"\nsoak: {CYCLES} cycles from {PROCESSES} processes in {elapsed:.1f} s "
            f"({CYCLES / elapsed:.0f}/s), failures {failures}; before {before}; after {after}"
        )
    assert failures == 0
    assert f'weight_cache_leases_granted_total{{via="request"}} {CYCLES + 300}.0' in metrics
    assert after["leases"] == before["leases"] == 0
    assert after["shm_files"] == before["shm_files"] == 1
    assert after["fds"] == before["fds"]
    assert after["threads"] == before["threads"]
    assert after["rss_kib"] - before["rss_kib"] < 16 * 1024, (before, after)

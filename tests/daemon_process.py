"""A real daemon for tests: ``weight-cache serve`` under uvicorn in a subprocess on a free
loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DaemonProcess:
    url: str
    process: subprocess.Popen[bytes]
    shm_dir: Path
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_daemon(
    tmp_path: Path,
    models: list[Path],
    *extra: str,
    port: int | None = None,
    shm_dir: Path | None = None,
    env: dict[str, str] | None = None,
    uds: Path | None = None,
    wait_ready: bool = True,
) -> DaemonProcess:
    port = port or free_port()
    shm_dir = shm_dir or tmp_path / "shm"
    shm_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_path / f"daemon-{port}-{time.monotonic_ns()}.log"
    args = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--port",
        str(port),
        "--shm-dir",
        str(shm_dir),
        "--device",
        "cpu",
    ]
    for m in models:
        args += ["--model", str(m)]
    if uds is not None:
        args += ["--uds", str(uds)]
    args += list(extra)
    full_env = {
        **os.environ,
        "WEIGHT_CACHE_CACHE_DIR": str(tmp_path / "cache"),
        "WEIGHT_CACHE_REAPER_INTERVAL_S": "0.05",
        **(env or {}),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    daemon = DaemonProcess(f"http://127.0.0.1:{port}", process, shm_dir, log)
    transport = httpx.HTTPTransport(uds=str(uds)) if uds else None
    poll = httpx.Client(transport=transport, base_url=daemon.url, timeout=1)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            poll.close()
            raise RuntimeError(f"daemon exited: {log.read_text()}")
        try:
            r = poll.get("/ready" if wait_ready else "/health")
            if r.status_code == 200:
                poll.close()
                return daemon
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            daemon.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon not ready: {log.read_text()}")
        time.sleep(0.1)

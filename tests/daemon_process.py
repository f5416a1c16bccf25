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
from typing import TYPE_CHECKING, Any

import httpx

from service.memory.shm import arena_dir_path

if TYPE_CHECKING:
    from service.settings import DaemonSettings


def lease_body(model: str = "tiny", **over: Any) -> dict[str, Any]:
    """A valid single-rank CUTLASS lease request as raw JSON (tests vary it field by field)."""
    body: dict[str, Any] = {
        "model": model,
        "tp_rank": 0,
        "tp_size": 1,
        "kernel": "cutlass",
        "format": "default",
        "client_pid": os.getpid(),
    }
    body.update(over)
    return body


def make_settings(tmp_path: Path, models: list[Path], **over: Any) -> DaemonSettings:
    """Settings for a CPU daemon serving ``models`` (the first as ``tiny``) from a private
    shared-memory directory under ``tmp_path``."""
    from service.settings import DaemonSettings

    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    values: dict[str, Any] = {
        "models": models,
        "model_id": "tiny",
        "device": "cpu",
        "shm_dir": shm,
        "cache_dir": tmp_path / "cache",
        "reaper_interval_s": 0.05,
    }
    values.update(over)
    return DaemonSettings(**values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DaemonProcess:
    url: str
    process: subprocess.Popen[bytes]
    shm_dir: Path  # the daemon's private arena directory under the --shm-dir given
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
    device: str = "cpu",
    timeout_s: float = 60.0,
    tree: Path | None = None,
) -> DaemonProcess:
    """``weight-cache serve`` of this checkout, or of the source tree ``tree`` (an earlier
    build, for before/after benchmarks), on a free port; returns once it is ready."""
    port = port or free_port()
    shm_dir = shm_dir or tmp_path / "shm"
    shm_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_path / f"daemon-{port}-{time.monotonic_ns()}.log"
    args = [
        sys.executable,
        "-m",
        "weight_cache_cli",
        "serve",
        "--port",
        str(port),
        "--shm-dir",
        str(shm_dir),
        "--device",
        device,
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
        **({"PYTHONPATH": str(tree)} if tree is not None else {}),
        **(env or {}),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=tree
        )
    daemon = DaemonProcess(f"http://127.0.0.1:{port}", process, arena_dir_path(shm_dir), log)
    transport = httpx.HTTPTransport(uds=str(uds)) if uds else None
    poll = httpx.Client(transport=transport, base_url=daemon.url, timeout=1)
    deadline = time.monotonic() + timeout_s
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


class InProcessDaemon:
    """The real app under uvicorn in a thread of this process, so a test can reach into the
    daemon's memory (e.g. write to an arena and watch an engine process see it)."""

    def __init__(self, settings: object) -> None:
        import threading

        import uvicorn

        from service.api.app import create_app

        self.port = free_port()
        self.app = create_app(settings.model_copy(update={"port": self.port}))  # type: ignore[attr-defined]
        # A daemon holding no model is not ready (nothing to lend): it is up once it answers.
        self.up_path = "/ready" if settings.models else "/health"  # type: ignore[attr-defined]
        self.daemon = self.app.state.daemon
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InProcessDaemon:
        self.thread.start()
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}{self.up_path}", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("in-process daemon not ready")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

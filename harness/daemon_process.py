"""A real daemon for tests: ``weight-cache serve`` under uvicorn in a subprocess on a free
loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from harness.waiting import wait_for
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
        # Its own run directory: a test may start several daemons from one tmp_path.
        "run_dir": Path(tempfile.mkdtemp(prefix="run-", dir=tmp_path)),
        "keeper": "off",
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
    run_dir: Path  # its handle socket and its keeper's socket

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

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
    run_dir: Path | None = None,
    keeper: str = "off",
    tree: Path | None = None,
) -> DaemonProcess:
    """``weight-cache serve`` of this checkout, or of the source tree ``tree`` (an earlier
    build, for before/after benchmarks), on ``port`` (a free one by default), its run directory
    ``run_dir`` (default ``tmp_path/run-<port>``: a daemon started again on the same port finds
    its keeper), the keeper ``keeper`` (off by default: a test that wants one says so)."""
    port = port or free_port()
    run_dir = run_dir or tmp_path / f"run-{port}"
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
        "WEIGHT_CACHE_RUN_DIR": str(run_dir),
        "WEIGHT_CACHE_KEEPER": keeper,
        **({"PYTHONPATH": str(tree)} if tree is not None else {}),
        **(env or {}),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=tree
        )
    daemon = DaemonProcess(
        f"http://127.0.0.1:{port}", process, arena_dir_path(shm_dir), log, run_dir
    )
    transport = httpx.HTTPTransport(uds=str(uds)) if uds else None
    poll = httpx.Client(transport=transport, base_url=daemon.url, timeout=1)

    def answering() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"daemon exited: {log.read_text()}")
        try:
            return poll.get("/ready" if wait_ready else "/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answering, timeout_s, every=0.1, what="the daemon answering")
    except AssertionError:
        daemon.stop(signal.SIGKILL)
        raise RuntimeError(f"daemon not ready: {log.read_text()}") from None
    finally:
        poll.close()
    return daemon


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

        def ready() -> bool:
            try:
                return httpx.get(f"{self.url}{self.up_path}", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120, what="the in-process daemon ready")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def keeper_status(run_dir: Path) -> Any:
    """The keeper's ``StatusReply`` on ``run_dir``, or None when none answers."""
    from service.keeper.control import keeper_status as ask

    return ask(run_dir)


def stop_keeper(run_dir: Path) -> None:
    """SIGTERM the keeper on ``run_dir`` (it lets go of everything) and wait until it is gone."""
    from service.keeper.control import stop_keeper as stop

    stop(run_dir)


class ComputingEngine:
    """``harness.computing_engine`` in a child process: attached, computing, answering."""

    def __init__(self, url: str, model: str, checkpoint: Path, device: str = "cpu") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "harness.computing_engine", url, model, str(checkpoint), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.attached = self._line()

    def _line(self) -> dict[str, Any]:
        import json

        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine exited ({self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str = "status") -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._line()

    def close(self) -> dict[str, Any]:
        answer = self.ask("close")
        self.process.wait(60)
        return answer

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class KeptDaemons:
    """A daemon whose arenas a keeper holds, and the daemon started after it on the same port,
    shared memory and run directory (a restart, an upgrade): ``with KeptDaemons(...) as kept:``
    starts the first (model ``tiny``); :meth:`restart` starts the next; leaving the block kills
    both and stops the keeper."""

    def __init__(self, tmp_path: Path, model: Path, device: str = "cpu") -> None:
        self.tmp_path, self.model, self.device = tmp_path, model, device
        self.port, self.shm, self.run = free_port(), tmp_path / "shm", tmp_path / "run"
        self.first = self._start()
        self.second: DaemonProcess | None = None

    def _start(self) -> DaemonProcess:
        return start_daemon(
            self.tmp_path,
            [self.model],
            "--model-id",
            "tiny",
            port=self.port,
            shm_dir=self.shm,
            device=self.device,
            run_dir=self.run,
            keeper="auto",
        )

    def restart(self) -> DaemonProcess:
        self.second = self._start()
        return self.second

    def keeper(self) -> Any:
        """The keeper's status (:func:`keeper_status`)."""
        return keeper_status(self.run)

    def __enter__(self) -> KeptDaemons:
        return self

    def __exit__(self, *exc: object) -> None:
        self.first.stop(signal.SIGKILL)
        if self.second is not None:
            self.second.stop()
        stop_keeper(self.run)

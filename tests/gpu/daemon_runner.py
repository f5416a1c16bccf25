"""The daemon as the GPU proofs run it: ``weight-cache serve`` in its own process, with the
options that choose how arenas are shared and kept (``--cuda-handles``, ``--run-dir``,
``--keeper``) defined here once, its start timed to ``/health`` and ``/ready``, and started again
with the same command after a ``kill -9``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine_client.client import ClientConfig, DaemonClient
from harness.waiting import poll
from protocol.processes import process_tree
from protocol.schemas.health import Readiness
from tests.gpu.processes import LoggedProcess, read_chars


@dataclass
class DaemonCommand:
    """``weight-cache serve`` for a proof. ``cuda_handles``, ``run_dir`` and ``keeper`` are
    passed only when set (a daemon without them runs with its defaults); no ``models``: the
    daemon starts with none (engines donate to it)."""

    port: int
    device: str
    shm_dir: Path
    models: list[Path]
    model_id: str | None = None
    cuda_handles: str | None = None
    run_dir: Path | None = None
    keeper: str | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "weight_cache_cli", "serve", "--port", str(self.port)]
        argv += ["--device", self.device, "--shm-dir", str(self.shm_dir)]
        for model in self.models:
            argv += ["--model", str(model)]
        if not self.models:  # none at start (with no --model at all it loads its demo model)
            argv += ["--model", ""]
        if self.model_id:
            argv += ["--model-id", self.model_id]
        if self.cuda_handles:
            argv += ["--cuda-handles", self.cuda_handles]
        if self.run_dir:
            argv += ["--run-dir", str(self.run_dir)]
        if self.keeper:
            argv += ["--keeper", self.keeper]
        return argv + self.extra

    def keeper_argv(self) -> list[str]:
        """The keeper in the foreground (``--keeper external``: the proof starts it)."""
        assert self.run_dir is not None, "a keeper needs the run directory"
        return [sys.executable, "-m", "weight_cache_cli", "keeper", "--run-dir", str(self.run_dir)]


def _answers_200(client: httpx.Client, path: str) -> bool:
    return _status(client, path) == 200


def _status(client: httpx.Client, path: str) -> int | None:
    try:
        return client.get(path).status_code
    except httpx.HTTPError:
        return None


class ServedDaemon:
    """One daemon command, started (and started again) as processes logged under ``logs``."""

    def __init__(self, command: DaemonCommand, logs: Path, env: dict[str, str]) -> None:
        self.command = command
        self.logs = logs
        self.env = env
        self.command.shm_dir.mkdir(parents=True, exist_ok=True)
        if self.command.run_dir is not None:
            self.command.run_dir.mkdir(parents=True, exist_ok=True)
        self.keeper: LoggedProcess | None = None
        self.runs: list[LoggedProcess] = []
        self.spawned: set[int] = set()  # processes a daemon started (``--keeper auto``'s keeper)

    @property
    def process(self) -> LoggedProcess:
        return self.runs[-1]

    def start(self) -> LoggedProcess:
        """Start the keeper first when it is external (once), then a daemon process."""
        if self.command.keeper == "external" and self.keeper is None:
            self.keeper = LoggedProcess(
                "keeper", self.command.keeper_argv(), self.logs / "keeper.log", env=self.env
            )
        run = len(self.runs) + 1
        self.runs.append(
            LoggedProcess(
                f"daemon-{run}", self.command.argv(), self.logs / f"daemon-{run}.log", env=self.env
            )
        )
        return self.process

    def wait_ready(self, timeout: float, holds_models: bool = True) -> dict[str, Any]:
        """Poll ``/health``, then ``/ready``; seconds from the process's start to each, the
        models as the daemon reports them, and the bytes the process had read by then. A
        daemon started to hold no model (``holds_models`` false: engines donate to it) answers
        ``/ready`` 503 until one is donated; it is ready once ``/health`` answers and
        ``/ready`` says it holds none and loads none (``readiness``)."""
        proc = self.process
        figures: dict[str, Any] = {"ready": False}
        deadline = time.monotonic() + timeout
        paths = ("/health", "/ready") if holds_models else ("/health",)
        with httpx.Client(base_url=self.command.url, timeout=2) as client:
            for path in paths:
                answered = poll(
                    functools.partial(_answers_200, client, path),
                    deadline - time.monotonic(),
                    every=0.02,
                    while_=proc.alive,
                )
                if answered is None:
                    figures["rc"] = proc.process.poll()
                    figures["tail"] = [line.text for line in proc.lines()[-20:]]
                    return figures
                figures[f"{path[1:]}_s"] = round(proc.since_start(), 3)
            readiness = Readiness.model_validate_json(client.get("/ready").content)
        figures["readiness"] = readiness.model_dump(mode="json")
        figures["ready"] = readiness.ready or (
            not holds_models and not readiness.models and not readiness.failed
        )
        figures["read_bytes"] = read_chars(proc.pid)
        self.spawned.update(process_tree(proc.pid)[1:])
        with self.client() as daemon:
            models = daemon.models()
        figures["models"] = [
            {
                "id": m.id,
                "state": str(m.state.value),
                "load_seconds": m.load_seconds,
                "bytes_resident": m.bytes_resident,
                "active_leases": m.active_leases,
            }
            for m in models
        ]
        return figures

    def client(self) -> DaemonClient:
        return DaemonClient(ClientConfig(url=self.command.url, retries=0))

    def kill(self) -> float:
        """``kill -9`` of the daemon's process alone (a keeper it started lives on); the
        monotonic time of the kill."""
        moment = time.monotonic()
        self.process.signal(signal.SIGKILL, group=False)
        self.process.wait_exit(10)
        return moment

    def keeper_pids(self) -> list[int]:
        """The keeper's process, started here (external) or by a daemon (auto)."""
        return ([self.keeper.pid] if self.keeper else []) + sorted(self.spawned)

    def stop(self) -> None:
        """Stop the daemon, then its keeper (SIGTERM: it lets go of everything it holds)."""
        for proc in self.runs:
            proc.stop(grace_s=20)
        if self.keeper is not None:
            self.keeper.stop(grace_s=10)
        for pid in self.spawned:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)

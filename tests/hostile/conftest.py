"""Hostile-input cases run against a real daemon process (uvicorn, the guarded front, the lease
reaper and the scrub as deployed) on 127.0.0.1, each with ``/health`` sampled throughout.

Limits are set low so each bound is reached in a few requests: 32 connections, 8 KiB of
headers, requests received within 1 s, 40 leases in all and 10 per client, 16 models and 2 loads
at once, a scrub every 0.2 s.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.daemon_process import DaemonProcess, lease_body, start_daemon
from harness.waiting import wait_for

LIMITS = {
    "WEIGHT_CACHE_MAX_CONNECTIONS": "32",
    "WEIGHT_CACHE_MAX_HEADER_BYTES": "8192",
    "WEIGHT_CACHE_REQUEST_TIMEOUT_S": "1",
    "WEIGHT_CACHE_MAX_LEASES": "40",
    "WEIGHT_CACHE_MAX_LEASES_PER_CLIENT": "10",
    "WEIGHT_CACHE_SCRUB_INTERVAL_S": "0.2",
    "WEIGHT_CACHE_MAX_MODELS": "16",
    "WEIGHT_CACHE_MAX_CONCURRENT_LOADS": "2",
}


@dataclass
class Hostile:
    daemon: DaemonProcess
    root: Path  # the one allowed root
    tiny: Path  # a good checkpoint below it
    client: httpx.Client

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def port(self) -> int:
        return self.daemon.port

    def checkpoint(self, name: str) -> Path:
        """A fresh copy of the tiny checkpoint below the allowed root, to break."""
        path = self.root / name
        shutil.copytree(self.tiny, path)
        return path

    def load(self, path: Path | str, model_id: str | None = None, **body: Any) -> httpx.Response:
        payload: dict[str, Any] = {"path": str(path), **body}
        if model_id is not None:
            payload["id"] = model_id
        return self.client.post("/v1/models", json=payload)

    def settled(self, model_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The model's info once it is no longer loading."""

        def settled() -> dict[str, Any] | None:
            info: dict[str, Any] = self.client.get(f"/v1/models/{model_id}").json()
            return None if info.get("state") == "loading" else info

        return wait_for(settled, timeout_s, every=0.02, what=f"model {model_id} done loading")

    def lease(self, **over: Any) -> httpx.Response:
        return self.client.post("/v1/leases", json=lease_body(**over))

    def unload(self, model_id: str) -> None:
        self.client.delete(f"/v1/models/{model_id}")

    def log(self) -> str:
        return self.daemon.log.read_text(errors="replace")


def _start(root: Path, tiny_fp8: Path, **env: str) -> Hostile:
    allowed = root / "allowed"
    allowed.mkdir()
    tiny = allowed / "tiny"
    shutil.copytree(tiny_fp8, tiny)
    daemon = start_daemon(
        root,
        [tiny],
        "--model-id",
        "tiny",
        "--allowed-root",
        str(allowed),
        env={**LIMITS, **env},
    )
    return Hostile(daemon, allowed, tiny, httpx.Client(base_url=daemon.url, timeout=30))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, tiny_fp8: Path) -> Iterator[Hostile]:
    served = _start(tmp_path_factory.mktemp("hostile"), tiny_fp8)
    yield served
    served.client.close()
    served.daemon.stop()
    assert "Application shutdown complete" in served.log(), served.log()[-3000:]


@pytest.fixture(scope="module")
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_fp8: Path
) -> Iterator[DaemonProcess]:
    """A daemon of the test module's own, started with the module's ``CAPS`` environment."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    daemon = start_daemon(
        tmp_path_factory.mktemp(name), [tiny_fp8], "--model-id", "tiny", env=request.module.CAPS
    )
    yield daemon
    daemon.stop()

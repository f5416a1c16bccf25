"""An in-process daemon (the real app and lifespan through Starlette's TestClient) serving the
tiny demo checkpoints from a private shared-memory directory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from harness.daemon_process import lease_body, make_settings
from harness.waiting import wait_for
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import ShmHandle
from protocol.schemas.models import ModelState
from protocol.shm import map_path
from service.api.app import create_app
from service.daemon import Daemon
from service.memory.shm import arena_dir_path


@dataclass
class Served:
    client: TestClient
    daemon: Daemon
    shm_dir: Path

    def wait_ready(self, model: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the model leaves 'loading'; its info as the API shows it (read from the
        daemon directly, so it works behind a token too)."""

        def settled() -> dict[str, Any] | None:
            info = self.daemon.model_info(self.daemon.model(model))
            return None if info.state is ModelState.loading else info.model_dump(mode="json")

        return wait_for(settled, timeout, every=0.01, what=f"model {model} done loading")

    def lease_body(self, **over: Any) -> dict[str, Any]:
        return lease_body(**over)

    def lease(self, **over: Any) -> LeaseGrant:
        """A lease granted (any refusal fails here), as the schema reads it."""
        r = self.client.post("/v1/leases", json=self.lease_body(**over))
        assert r.status_code == 201, r.text
        return LeaseGrant.model_validate(r.json())

    def mapped_arena(self, grant: LeaseGrant) -> torch.Tensor:
        """The shared-memory arena ``grant`` lends, mapped read-only as an engine maps it."""
        handle = grant.arenas[0].handle
        assert isinstance(handle, ShmHandle)
        return map_path(Path(handle.path), handle.size)

    def snapshot(self) -> dict[str, Any]:
        """What must not change when a request is refused."""
        inv = self.client.get("/v1/inventory").json()
        return {
            "leases": sorted(x["id"] for x in self.client.get("/v1/leases").json()),
            "models": {
                m["id"]: (m["state"], m["bytes_resident"], m["active_leases"])
                for m in inv["models"]
            },
            "cache_bytes": inv["cache_bytes"],
            "shm_files": sorted(p.name for p in self.shm_dir.iterdir()),
        }


@pytest.fixture
def serve(tmp_path: Path, tiny_fp8: Path, demo_root: Path):
    """Start a daemon with settings overrides; yields a factory so tests can configure it."""
    stack: list[TestClient] = []

    def start(models: list[Path] | None = None, wait: bool = True, **over: Any) -> Served:
        over.setdefault("allowed_roots", [demo_root, tmp_path])
        settings = make_settings(tmp_path, [tiny_fp8] if models is None else models, **over)
        app = create_app(settings)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        stack.append(client)
        served = Served(client, app.state.daemon, arena_dir_path(settings.shm_dir))
        if settings.models and wait:
            served.wait_ready(settings.model_id or "tiny")
        return served

    yield start
    for client in reversed(stack):
        client.__exit__(None, None, None)


@pytest.fixture
def served(serve) -> Iterator[Served]:
    yield serve()

"""``weight-cache standby`` speaks to ``vllm serve`` through vLLM's own sleep endpoints
(``engine_client/engine_api.py``). These run the client against vLLM 0.33's real router (its
engine a stand-in that records the calls) and read how vLLM serves them: they fail on the vLLM
version where a route, a parameter, an answer or the variable that enables them changes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine_client.engine_api import DEV_MODE_VARIABLE, SLEEP_FLAG, EngineApi


class RecordingEngine:
    """What vLLM's router calls on ``app.state.engine_client`` for these routes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.sleeping = False

    async def sleep(self, level: int, mode: str) -> None:
        self.calls.append(("sleep", (level, mode)))
        self.sleeping = True

    async def wake_up(self, tags: list[str] | None) -> bool:
        self.calls.append(("wake_up", tags))
        self.sleeping = False
        return True

    async def is_sleeping(self) -> bool:
        return self.sleeping


def test_the_client_drives_vllms_sleep_router() -> None:
    from vllm.entrypoints.serve.dev.sleep.api_router import attach_router

    app = FastAPI()
    attach_router(app)
    engine = RecordingEngine()
    app.state.engine_client = engine
    api = EngineApi("http://engine", client=TestClient(app, base_url="http://engine"))
    assert api.is_sleeping() is False
    api.sleep(1)
    assert api.is_sleeping() is True
    api.wake_up()
    assert api.is_sleeping() is False
    assert engine.calls == [("sleep", (1, "wait")), ("wake_up", None)]


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin
    return Path(spec.origin).read_text()


def test_vllm_serves_them_only_in_dev_mode_and_sleep_mode_is_a_flag() -> None:
    routers = _source("vllm.entrypoints.launchers.api_server.routers")
    assert f"envs.{DEV_MODE_VARIABLE}:" in routers
    assert "register_vllm_dev_api_routers(app)" in routers
    assert "attach_sleep_router(app)" in _source("vllm.entrypoints.serve")
    from vllm.engine.arg_utils import EngineArgs

    assert hasattr(EngineArgs, "enable_sleep_mode")
    assert "--" + "enable_sleep_mode".replace("_", "-") == SLEEP_FLAG

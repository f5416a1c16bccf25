"""The ``weight_cache`` loader as vLLM's worker drives it: the query before the load window
changes nothing, the before-window hook freezes the startup heap, and the checkpoint's identity
is read once per engine start although each call gets a new loader."""

from __future__ import annotations

import gc
from pathlib import Path

import httpx
import pytest

from harness.daemon_process import DaemonProcess, free_port
from tests.vllm.test_plugin import load_allowing_missing_cpu_ops, observe_default_loader
from tests.vllm.vllm_model import configs, vllm_world


def _rank_bytes(daemon: DaemonProcess) -> int:
    (model,) = httpx.get(f"{daemon.url}/v1/models").json()
    return int(model["bytes_resident"]) // int(model["tp_size"])


def test_the_query_changes_nothing_and_the_hook_freezes(
    daemon_process: DaemonProcess, tiny_fp8: Path
) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from engine_client.vllm_plugin import register

    register()
    vllm_config, _ = configs(tiny_fp8, "weight_cache", {"url": daemon_process.url})
    loader = get_model_loader(vllm_config.load_config)
    gc.unfreeze()
    try:
        with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
            held = loader.daemon_rank_bytes(vllm_config)
            assert held == _rank_bytes(daemon_process) > 0
            assert gc.get_freeze_count() == 0
            assert httpx.get(f"{daemon_process.url}/v1/leases").json() == []
            assert loader.get_external_weight_memory(vllm_config) == held
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_without_a_daemon_nothing_is_held(tiny_fp8: Path) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from engine_client.vllm_plugin import register

    register()
    url = f"http://127.0.0.1:{free_port()}"
    vllm_config, _ = configs(tiny_fp8, "weight_cache", {"url": url})
    with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
        assert get_model_loader(vllm_config.load_config).daemon_rank_bytes(vllm_config) == 0


def test_the_identity_is_read_once_per_engine_start(
    daemon_process: DaemonProcess, tiny_fp8: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's query and its load, each on a loader of its own, read the checkpoint's
    identity once between them; the next engine start (a new config) reads it again."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from engine_client.verify import EngineCheckpoint
    from engine_client.vllm_plugin import register

    register()
    reads: list[Path] = []
    real = EngineCheckpoint.read.__func__  # type: ignore[attr-defined]

    def counted(cls: type[EngineCheckpoint], path: Path, *args: object) -> EngineCheckpoint:
        reads.append(path)
        return real(cls, path, *args)  # type: ignore[no-any-return]

    monkeypatch.setattr(EngineCheckpoint, "read", classmethod(counted))
    delegated = observe_default_loader(monkeypatch)
    for engine_start in (1, 2):
        vllm_config, model_config = configs(tiny_fp8, "weight_cache", {"url": daemon_process.url})
        with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
            query = get_model_loader(vllm_config.load_config)
            assert query.daemon_rank_bytes(vllm_config) > 0
            load = get_model_loader(vllm_config.load_config)
            assert load is not query
            load_allowing_missing_cpu_ops(load, vllm_config, model_config, delegated)
        # vLLM's CPU platform picks another kernel: the load found the model, then fell back
        assert load.fallback_reason == "kernel_mismatch"
        assert reads == [tiny_fp8] * engine_start

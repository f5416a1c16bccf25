"""The ``weight_cache`` loader with ``park: true`` inside vLLM 0.33 (CPU platform): it waits at
the load step, registered with the daemon, and once released builds exactly the model state it
builds without parking; cancelled or timed out, it falls back or fails with the park's reason.
At TP 2 the two ranks park as one engine (one group) and are released together."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from torch.multiprocessing.spawn import start_processes

from harness.daemon_process import DaemonProcess, free_port, start_daemon
from harness.waiting import wait_for
from tests.conftest import FIXTURES
from tests.vllm.model_state import model_state
from tests.vllm.test_plugin import load_allowing_missing_cpu_ops, observe_default_loader
from tests.vllm.variants import make_variant
from tests.vllm.vllm_model import configs, cutlass_kernel_on_cpu, vllm_world


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, Path]]:
    """A daemon holding the Llama export (with equal fused scales, as the state tests use) at
    TP 1 as ``llama`` and at TP 2 as ``llama-tp2``."""
    root = tmp_path_factory.mktemp("parking")
    checkpoint = make_variant(FIXTURES / "modelopt" / "llama-fp8-kv", root / "llama")
    daemon = start_daemon(
        tmp_path_factory.mktemp("daemon"), [], "--allowed-root", str(root), wait_ready=False
    )
    try:
        with httpx.Client(base_url=daemon.url, timeout=30) as http:
            for model_id, tp in (("llama", 1), ("llama-tp2", 2)):
                body = {"path": str(checkpoint), "id": model_id, "tp_size": tp}
                assert http.post("/v1/models", json=body).status_code == 202
            wait_for(
                lambda: {m["state"] for m in http.get("/v1/models").json()} == {"ready"},
                timeout=120,
            )
        yield daemon, checkpoint
    finally:
        daemon.stop()


def _load(
    url: str,
    checkpoint: Path,
    extra: dict[str, Any] | None,
    tp: int = 1,
    rank: int = 0,
    port: int | None = None,
):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader import get_model_loader

    import engine_client.vllm_plugin

    engine_client.vllm_plugin.register()
    rotary_embedding._ROPE_DICT.clear()  # as in a fresh engine process
    load_format = "auto" if extra is None else "weight_cache"
    vllm_config, model_config = configs(checkpoint, load_format, extra, tp_size=tp)
    with set_current_vllm_config(vllm_config), vllm_world(tp, rank, port or free_port()):
        loader = get_model_loader(vllm_config.load_config)
        return loader, loader.load_model(vllm_config, model_config)


def _release_once_parked(url: str, loaded: threading.Event, seen: list[str]) -> None:
    """Wait for the engine to park; note whether its load had returned; release it."""
    wait_for(lambda: bool(httpx.get(f"{url}/v1/parking").json()), timeout=60)
    (entry,) = httpx.get(f"{url}/v1/parking").json()
    seen.append("loaded" if loaded.is_set() else entry["state"])
    httpx.post(f"{url}/v1/parking/{entry['id']}/release").raise_for_status()


def test_a_parked_load_waits_then_builds_the_same_state(served) -> None:
    daemon, checkpoint = served
    extra = {"url": daemon.url, "model": "llama", "fallback": False, "park": True}
    loaded, seen = threading.Event(), list[str]()
    releaser = threading.Thread(target=_release_once_parked, args=(daemon.url, loaded, seen))
    releaser.start()
    with cutlass_kernel_on_cpu():
        loader, model = _load(daemon.url, checkpoint, extra)
        loaded.set()
        releaser.join(60)
        _, default_model = _load(daemon.url, checkpoint, None)
    assert seen == ["parked"]  # registered and waiting while the load had not returned
    assert loader.attachment is not None and loader.fallback_reason is None
    assert model_state(default_model).differences(model_state(model)) == []
    leases = httpx.get(f"{daemon.url}/v1/leases").json()
    assert [x["client_pid"] for x in leases] == [os.getpid()]
    assert httpx.get(f"{daemon.url}/v1/parking").json() == []  # withdrawn once released
    loader.attachment.close()


def test_a_timed_out_park_falls_back_with_its_reason(served, monkeypatch) -> None:
    daemon, checkpoint = served
    delegated = observe_default_loader(monkeypatch)
    extra = {"url": daemon.url, "model": "llama", "park": True, "park_timeout": 0.5}
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    import engine_client.vllm_plugin

    engine_client.vllm_plugin.register()
    vllm_config, model_config = configs(checkpoint, "weight_cache", extra)
    loader = get_model_loader(vllm_config.load_config)
    with set_current_vllm_config(vllm_config), vllm_world(port=free_port()):
        load_allowing_missing_cpu_ops(loader, vllm_config, model_config, delegated)
    assert loader.fallback_reason == "park_timeout"
    assert [c.load_format for c in delegated.configs] == ["auto"]
    assert httpx.get(f"{daemon.url}/v1/parking").json() == []


def test_a_cancelled_park_fails_without_fallback(served) -> None:
    from protocol.errors import ParkEndedError
    from protocol.reasons import Reason

    daemon, checkpoint = served
    extra = {"url": daemon.url, "model": "llama", "fallback": False, "park": True}

    def cancel_once_parked() -> None:
        wait_for(lambda: bool(httpx.get(f"{daemon.url}/v1/parking").json()), timeout=60)
        (entry,) = httpx.get(f"{daemon.url}/v1/parking").json()
        httpx.post(f"{daemon.url}/v1/parking/{entry['id']}/cancel").raise_for_status()

    canceller = threading.Thread(target=cancel_once_parked)
    canceller.start()
    with cutlass_kernel_on_cpu(), pytest.raises(ParkEndedError) as raised:
        _load(daemon.url, checkpoint, extra)
    canceller.join(60)
    assert raised.value.reason is Reason.park_cancelled
    assert httpx.get(f"{daemon.url}/v1/parking").json() == []


def _rank(rank: int, url: str, checkpoint: str, port: int, out: str) -> None:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    extra = {"url": url, "model": "llama-tp2", "fallback": False, "park": True}
    with cutlass_kernel_on_cpu():
        loader, _ = _load(url, Path(checkpoint), extra, tp=2, rank=rank, port=port)
    attachment = loader.attachment
    result = {"attached": attachment is not None, "rank": attachment.manifest.tp_rank}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    attachment.close()


def test_tp_ranks_park_as_one_engine_and_are_released_together(served, tmp_path: Path) -> None:
    daemon, checkpoint = served
    url = daemon.url
    parked: list[list[dict[str, Any]]] = []
    released: list[list[dict[str, Any]]] = []

    def release_when_both_parked() -> None:
        wait_for(lambda: len(httpx.get(f"{url}/v1/parking").json()) == 2, timeout=120)
        parked.append(httpx.get(f"{url}/v1/parking").json())
        released.append(httpx.post(f"{url}/v1/parking/{parked[0][0]['id']}/release").json())

    releaser = threading.Thread(target=release_when_both_parked)
    releaser.start()
    start_processes(
        _rank,
        args=(url, str(checkpoint), free_port(), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    releaser.join(60)
    (entries,) = parked
    assert len({e["group"] for e in entries}) == 1  # one engine
    assert sorted(e["tp_rank"] for e in entries) == [0, 1]
    assert sorted(e["tp_rank"] for e in released[0]) == [0, 1]  # both, by one id
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "attached": True,
            "rank": rank,
        }

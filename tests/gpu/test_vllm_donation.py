"""Donated models through vLLM 0.33 on a GPU (run on a GPU with vLLM): a bf16 checkpoint the
daemon does not process, on the qwen2.5-0.5b shape. Engine A loads it with vLLM's default
loader; engine D (``--load-format weight_cache``) loads it the same way and donates it into the
daemon's GPU arena; engine E attaches to it. Each engine runs in its own process, one after the
other. D and E generate A's tokens and hold A's state (every parameter, buffer, tensor and plain
attribute), none of their weights in their own allocator; D holds one copy of the weights, not
two (its GPU memory per NVML no more than E's, which never loaded any, by less than half the
weights); E donated nothing. The same with ``--enable-sleep-mode``, where vLLM's own pool
allocator holds D's load."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.checkpoint_tools import dequantized
from harness.daemon_process import DaemonProcess, start_daemon
from service.demo import write_demo_checkpoint
from tests.gpu.processes import LoggedProcess
from tests.gpu.vllm_logs import KV_CACHE, loading_figures
from tests.vllm.model_state import ModelState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.33"),
]
ENGINE_TIMEOUT_S = 600.0
KV_SLACK_GIB = 0.25  # allocator rounding and workspaces between two engines' profiles
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("donated")
    fp8 = write_demo_checkpoint(root / "fp8", "fp8", "qwen2.5-0.5b", device="cuda")
    return dequantized(fp8, root / "bf16")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tmp_path, [], device="cuda:0", timeout_s=300)
    yield process
    process.stop()


def engine(
    name: str, ckpt: Path, work: Path, sleep_mode: bool, url: str | None = None
) -> dict[str, Any]:
    """One engine in its own process (EngineCore in it too): its RESULT, its load figures and
    its log."""
    cmd = [sys.executable, "-m", "tests.gpu.vllm_engine", str(ckpt), "--gpu-memory"]
    cmd += ["--state", str(work / f"{name}.state.json")]
    if url is not None:
        cmd += ["--load-format", "weight_cache", "--url", url, "--fallback", "false"]
    if sleep_mode:
        cmd.append("--sleep-mode")
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = LoggedProcess(name, cmd, work / f"{name}.log", env=env, cwd=REPO)
    proc.wait_exit(ENGINE_TIMEOUT_S)
    proc.stop()
    text = proc.text()
    results = [
        json.loads(x[len("RESULT ") :]) for x in text.splitlines() if x.startswith("RESULT ")
    ]
    assert results and results[-1]["ok"], (name, text[-4000:])
    result: dict[str, Any] = results[-1]
    result.update(loading_figures(text))
    result["log"] = text
    return result


def kv_cache_gib(log: str) -> float:
    """The KV cache an engine's profile left it (vLLM's "Available KV cache memory")."""
    found = KV_CACHE.search(log)
    assert found is not None, log[-2000:]
    return float(found.group(1))


def state(work: Path, name: str) -> tuple[ModelState, dict[str, bool]]:
    raw = json.loads((work / f"{name}.state.json").read_text())
    tensors = {k: tuple(v) for k, v in raw["tensors"].items()}
    return ModelState(tensors, raw["aliases"], raw["attributes"]), raw["in_engine_allocator"]


@pytest.mark.parametrize("sleep_mode", [False, True], ids=["plain", "sleep-mode"])
def test_a_donor_and_an_attacher_compute_what_the_default_loader_does(
    bf16: Path, daemon: DaemonProcess, tmp_path: Path, sleep_mode: bool
) -> None:
    a = engine("A", bf16, tmp_path, sleep_mode)
    d = engine("D", bf16, tmp_path, sleep_mode, daemon.url)
    said = [x for x in d["log"].splitlines() if "weight-cache:" in x]
    assert any("weight-cache: donated" in x for x in said), said
    with httpx.Client(base_url=daemon.url) as http:
        donations = http.get("/v1/donations").json()
        assert [x["donor"]["pid"] for x in donations] == [d["pid"]], donations
        model = http.get(f"/v1/models/{donations[0]['model']}").json()
    assert donations[0]["key"]["device_kind"] == "cuda" and donations[0]["state"] == "ready"
    e = engine("E", bf16, tmp_path, sleep_mode, daemon.url)
    with httpx.Client(base_url=daemon.url) as http:
        assert [x["model"] for x in http.get("/v1/donations").json()] == [model["id"]]
    assert f"attached donated model {model['id']}" in e["log"]

    assert d["tokens"] == a["tokens"] and e["tokens"] == a["tokens"]
    # Both keep the default loader's meaning of --gpu-memory-utilization: its KV cache. (The
    # donor once counted only what its own allocator held after giving its weights away: three
    # times the default loader's KV cache on the 8B shape, beyond its budget.)
    kv = {name: kv_cache_gib(r["log"]) for name, r in (("A", a), ("D", d), ("E", e))}
    assert abs(kv["D"] - kv["A"]) <= KV_SLACK_GIB and abs(kv["E"] - kv["A"]) <= KV_SLACK_GIB, kv
    expected, _ = state(tmp_path, "A")
    for name in ("D", "E"):
        got, in_engine = state(tmp_path, name)
        assert expected.differences(got) == [], name
        assert sorted(p for p, mine in in_engine.items() if mine) == [], name

    weights = model["bytes_resident"]
    gpu = {name: r["gpu_bytes"] for name, r in (("A", a), ("D", d), ("E", e))}
    if None in gpu.values():
        pytest.skip(f"neither NVML nor nvidia-smi reads GPU memory per process here: {gpu}")
    # One copy in the donor: what it holds exceeds what an engine that never loaded the weights
    # holds by less than half of them (two copies would be a whole copy more), and it holds no
    # more than the default loader's engine does beside it.
    assert gpu["D"] < gpu["E"] + weights // 2, (gpu, weights, d["model_loading_gib"])
    assert gpu["D"] < gpu["A"] + weights // 2, (gpu, weights)

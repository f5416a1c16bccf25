"""Real daemon process, real engine processes: a fine-tune of the served checkpoint (same
architecture and shapes, other weights) is told apart and falls back; the served checkpoint
attaches at every tier that applies; an arena removed under the daemon fails its model, engines
fall back, and the engine that had mapped it keeps its bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.daemon_process import DaemonProcess, start_daemon
from harness.waiting import wait_for
from service.demo import write_demo_checkpoint

CLI = [sys.executable, "-m", "weight_cache_cli"]
CHILD = [sys.executable, "-m", "tests.integration.engine_child"]


def run(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=check)


def engine_load(url: str, model: str, checkpoint: Path, tier: str = "sampled") -> dict[str, str]:
    out = run([*CHILD, "load", url, model, str(checkpoint), tier])
    result: dict[str, str] = json.loads(out.stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("seeds")
    return (
        write_demo_checkpoint(root / "A", "fp8", "tiny", seed=1),
        write_demo_checkpoint(root / "B", "fp8", "tiny", seed=2),
    )


@pytest.fixture
def serving_a(tmp_path: Path, seeds: tuple[Path, Path]):
    daemon = start_daemon(tmp_path, [seeds[0]], "--model-id", "a")
    yield daemon
    daemon.stop()


def test_a_fine_tune_is_refused_and_falls_back(
    serving_a: DaemonProcess, seeds: tuple[Path, Path]
) -> None:
    b = seeds[1]
    url = serving_a.url
    refused = run([*CLI, "attach", "--url", url, "--model", "a", "--checkpoint", str(b)], False)
    assert refused.returncode == 1
    assert "fingerprint_mismatch" in refused.stderr and "tier sampled" in refused.stderr
    assert engine_load(url, "a", b) == {"source": "disk", "reason": "fingerprint_mismatch"}
    assert httpx.get(f"{url}/v1/leases").json() == []


@pytest.mark.parametrize("tier", ["files", "sampled", "full"])
def test_the_served_checkpoint_attaches_at_every_tier(
    serving_a: DaemonProcess, seeds: tuple[Path, Path], tier: str
) -> None:
    a, _ = seeds
    args = ["--model", "a", "--checkpoint", str(a), "--identity", tier, "--check", "--json"]
    out = run([*CLI, "attach", "--url", serving_a.url, *args])
    report = json.loads(out.stdout)
    assert report["zero_copy"] is True and report["matches_disk_load"] is True
    assert engine_load(serving_a.url, "a", a, tier) == {"source": "daemon", "reason": None}


def test_hf_blob_tier_outside_a_cache_falls_back(
    serving_a: DaemonProcess, seeds: tuple[Path, Path]
) -> None:
    result = engine_load(serving_a.url, "a", seeds[0], "hf_blob")
    assert result == {"source": "disk", "reason": "fingerprint_mismatch"}


def test_a_lost_arena_fails_the_model_and_engines_fall_back(tmp_path: Path, tiny_fp8: Path) -> None:
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", "--allowed-root", str(tiny_fp8.parent)
    )
    url = daemon.url
    holder = subprocess.Popen(
        [*CHILD, "attach-hold", url, "tiny", str(tiny_fp8)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdin is not None and holder.stdout is not None
        before = json.loads(holder.stdout.readline())["checksum"]
        (arena,) = daemon.shm_dir.iterdir()
        arena.unlink()

        assert engine_load(url, "tiny", tiny_fp8) == {"source": "disk", "reason": "model_failed"}
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and "arena_lost" in ready.json()["failed"]["tiny"]
        (model,) = httpx.get(f"{url}/v1/inventory").json()["models"]
        assert model["state"] == "failed" and model["error"]["code"] == "arena_lost"
        assert list(daemon.shm_dir.iterdir()) == []  # nothing granted names a file

        holder.stdin.write("go\n")
        holder.stdin.close()
        assert json.loads(holder.stdout.readline())["checksum"] == before
        assert holder.wait(60) == 0
        # The operator's way back: unload and load again.
        assert httpx.delete(f"{url}/v1/models/tiny").status_code == 204
        httpx.post(f"{url}/v1/models", json={"path": str(tiny_fp8), "id": "tiny"})
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200)
        assert engine_load(url, "tiny", tiny_fp8) == {"source": "daemon", "reason": None}
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        daemon.stop()

"""``weight-cache attach`` and ``weight-cache status`` against a real daemon."""

from __future__ import annotations

import json
import subprocess

from harness.cli import CLI, run_cli
from harness.daemon_process import free_port


def test_attach_check_json(daemon_process) -> None:
    out = run_cli("attach", "--url", daemon_process.url, "--check", "--json", check=True)
    report = json.loads(out.stdout)
    assert report["model"] == "tiny" and report["tensors"] == 35 and report["layers"] == 8
    assert report["zero_copy"] is True and report["matches_disk_load"] is True
    assert (
        report["bytes"] > 0 and report["lease_ms"] > 0 and report["attach_ms"] >= report["lease_ms"]
    )


def test_attach_reports_a_missing_daemon() -> None:
    out = run_cli("attach", "--url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 1 and "daemon_unavailable" in out.stderr


def test_status_table(daemon_process) -> None:
    out = run_cli("status", "--url", daemon_process.url, check=True)
    assert "tiny" in out.stdout and "ready" in out.stdout and "FP8" in out.stdout


def test_status_finds_the_daemon_from_its_own_variables(daemon_process) -> None:
    """The variables that placed the daemon are enough for a client to find it."""
    import os

    port = daemon_process.url.rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHT_CACHE_")}

    def status(on_port: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, "status"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**env, "WEIGHT_CACHE_PORT": on_port},
        )

    out = status(port)
    assert out.returncode == 0, out.stderr
    assert "tiny" in out.stdout and "ready" in out.stdout
    out = status(str(free_port()))
    assert out.returncode == 1 and "[daemon_unavailable]" in out.stderr
    assert "--url / --uds (or WEIGHT_CACHE_URL" in out.stderr  # the CLI's own advice


def test_sizing_shares_the_gpu_out(daemon_process) -> None:
    from engine_client.sizing import shared_utilization

    def sizing(engines: int) -> dict[str, int | float]:
        out = run_cli(
            "sizing", "--url", daemon_process.url, "--engines", str(engines), "--json", check=True
        )
        answer: dict[str, int | float] = json.loads(out.stdout)
        return answer

    one, four = sizing(1), sizing(4)
    assert one["weight_bytes"] > 0 and one["daemon_bytes"] >= one["weight_bytes"]
    assert four["gpu_memory_utilization"] < one["gpu_memory_utilization"]
    expected = shared_utilization(
        int(four["device_total_bytes"]), int(four["daemon_bytes"]), int(four["weight_bytes"]), 4
    )
    assert four["gpu_memory_utilization"] == expected.utilization

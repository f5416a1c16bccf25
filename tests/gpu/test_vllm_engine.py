"""vLLM 0.33 itself on a GPU through the ``weight_cache`` loader (``vllm_engine_proof``):
tokens and model state equal to vLLM's default loader, attached and fallen back, on the tied
qwen2.5-0.5b shape, both schemes, KV cache auto and fp8. The llama-8b shape and the load-time
figures run with ``python -m tests.gpu.vllm_engine_proof --timing`` (README)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM 0.33"),
]


def test_vllm_engines_compute_what_the_default_loader_does(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.gpu.vllm_engine_proof",
            "--root",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--shapes",
            "qwen2.5-0.5b",
            "--budget-s",
            "900",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    summary = json.loads((out / "summary.json").read_text())
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:])
    assert len(summary["checks"]) >= 4 * (3 + 3 + 2) + 3

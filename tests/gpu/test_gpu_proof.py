"""The end-to-end GPU proof, on the tiny shape, as a test: both schemes attached over CUDA IPC
from a daemon process, bitwise equal to an ordinary load, zero-copy, no engine allocation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.gpu_proof import main

pytestmark = pytest.mark.gpu


def test_gpu_proof_passes_on_the_tiny_shape(tmp_path: Path) -> None:
    summary = main(tmp_path, "tiny")
    assert summary["daemon_device"] == "cuda:0"
    assert [run.get("error") for run in summary["runs"]] == [None, None]
    assert summary["all_checks_passed"], summary["runs"]

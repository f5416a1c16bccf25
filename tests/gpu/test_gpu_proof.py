"""The end-to-end GPU proof, on the tiny shape, as a test: both schemes attached from a daemon
process (descriptors, and legacy CUDA IPC), bitwise equal to an ordinary load, zero-copy, no
engine allocation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.gpu_proof import main

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("handles", ["fd", "ipc"])
def test_gpu_proof_passes_on_the_tiny_shape(tmp_path: Path, handles: str) -> None:
    summary = main(tmp_path, "tiny", handles)
    assert summary["daemon_device"] == "cuda:0" and summary["cuda_handles"] == handles
    via = "descriptor" if handles == "fd" else "cuda_ipc"
    assert all(run["attach_1"]["via"] == via for run in summary["runs"])
    assert [run.get("error") for run in summary["runs"]] == [None, None]
    assert summary["all_checks_passed"], summary["runs"]

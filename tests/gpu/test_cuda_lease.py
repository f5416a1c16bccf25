"""CUDA IPC for real (run on a GPU): a second process rebuilds a CUDA lease with the manifest's
dtype, shape and stride and the daemon's bytes, and sees a write the daemon makes afterwards,
which proves it maps the daemon's memory rather than a copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.memory.checksum import storage_checksum
from service.settings import DaemonSettings
from tests.daemon_process import InProcessDaemon

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scheme", ["fp8", "fp8-pc-pt"])
def test_second_process_maps_the_daemons_cuda_arena(
    tmp_path: Path, tiny_fp8: Path, tiny_pc: Path, scheme: str
) -> None:
    ckpt = tiny_fp8 if scheme == "fp8" else tiny_pc
    settings = DaemonSettings(
        models=[ckpt],
        model_id="tiny",
        device="cuda:0",
        shm_dir=tmp_path,
        cache_dir=tmp_path / "cache",
    )
    with InProcessDaemon(settings) as served:
        rank = served.daemon.models["tiny"].ranks[0]
        manifest = rank.manifest
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.cuda_engine_child", served.url, "tiny", str(ckpt)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        try:
            report = json.loads(child.stdout.readline())
            assert report["zero_copy"] and report["device"] == "cuda:0"
            for entry in manifest.tensors:
                seen = report["tensors"][entry.name]
                assert seen["dtype"] == entry.dtype.value
                assert (seen["shape"], seen["stride"]) == (entry.shape, entry.stride)
                assert seen["offset"] == entry.offset
                assert seen["checksum"] == entry.checksum, entry.name
            # The daemon overwrites the first weight in place; the engine must see it.
            first = manifest.tensors[0]
            region = rank.arena.base[first.offset : first.offset + first.nbytes]
            region.copy_(
                torch.arange(first.nbytes, device=region.device, dtype=torch.int64)
                .remainder(251)
                .to(torch.uint8)
            )
            torch.cuda.synchronize()
            expected = storage_checksum(region)
            assert expected != first.checksum
            child.stdin.write("go\n")
            child.stdin.flush()
            assert json.loads(child.stdout.readline())["checksum"] == expected
        finally:
            child.stdin.close()
            assert child.wait(60) == 0
        assert served.daemon.leases.count() == 0  # the child released its lease on close

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


REFUSED_CHILD = """
import sys, torch
from pathlib import Path
from engine_client.attach import attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from service.errors import VerificationError
try:
    attach("tiny", Expectations.for_checkpoint(Path(sys.argv[2]), torch.device("cuda", 0)),
           config=ClientConfig(url=sys.argv[1]))
except VerificationError as exc:
    print(exc.reason)
"""


@pytest.mark.parametrize("engine", ["refused", "attached"])
def test_unloading_frees_the_gpu_memory_engines_let_go(
    tmp_path: Path, tiny_fp8: Path, tiny_pc: Path, engine: str
) -> None:
    """Every export counts one consumer in torch's IPC reference count. An engine that attached
    and exited, or one that refused the lease without opening it, must both hand their count
    back, or the daemon could never free the arena after an unload."""
    settings = DaemonSettings(
        models=[tiny_fp8],
        model_id="tiny",
        device="cuda:0",
        shm_dir=tmp_path,
        cache_dir=tmp_path / "cache",
    )
    with InProcessDaemon(settings) as served:
        arena_bytes = served.daemon.models["tiny"].bytes_resident
        loaded = torch.cuda.memory_allocated(0)
        if engine == "refused":
            out = subprocess.run(
                [sys.executable, "-c", REFUSED_CHILD, served.url, str(tiny_pc)],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            assert out.stdout.strip() == "fingerprint_mismatch"
        else:
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.gpu.cuda_engine_child",
                    served.url,
                    "tiny",
                    str(tiny_fp8),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdin is not None and child.stdout is not None
            assert json.loads(child.stdout.readline())["zero_copy"]
            child.stdin.write("go\n")
            child.stdin.close()
            child.stdout.readline()
            assert child.wait(60) == 0
        assert served.daemon.leases.count() == 0
        served.daemon.unload("tiny")
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated(0) <= loaded - arena_bytes

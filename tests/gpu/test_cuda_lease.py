"""CUDA IPC for real (run on a GPU): a second process rebuilds a CUDA lease with the manifest's
dtype, shape and stride and the daemon's bytes, and sees a write the daemon makes afterwards,
which proves it maps the daemon's memory rather than a copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.daemon_process import InProcessDaemon, make_settings
from harness.python_child import run_python
from protocol.checksum import storage_checksum

pytestmark = pytest.mark.gpu


def spawn_engine(url: str, checkpoint: Path) -> subprocess.Popen[str]:
    """``cuda_engine_child`` attached to model ``tiny``: it reports its tensors on a line, then
    on "go" reports the first weight's checksum and exits."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.cuda_engine_child", url, "tiny", str(checkpoint)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    return child


@pytest.mark.parametrize("handles", ["fd", "ipc"])
@pytest.mark.parametrize("scheme", ["fp8", "fp8-pc-pt"])
def test_second_process_maps_the_daemons_cuda_arena(
    tmp_path: Path, tiny_fp8: Path, tiny_pc: Path, scheme: str, handles: str
) -> None:
    """Both handle kinds: the engine maps the daemon's memory itself (zero copy), with the
    manifest's layout and bytes, and sees the daemon's later write."""
    ckpt = tiny_fp8 if scheme == "fp8" else tiny_pc
    settings = make_settings(tmp_path, [ckpt], device="cuda:0", cuda_handles=handles)
    with InProcessDaemon(settings) as served:
        rank = served.daemon.model("tiny").ranks[0]
        manifest = rank.manifest
        child = spawn_engine(served.url, ckpt)
        assert child.stdin is not None and child.stdout is not None
        try:
            report = json.loads(child.stdout.readline())
            assert report["zero_copy"] and report["device"] == "cuda:0"
            assert report["via"] == ("descriptor" if handles == "fd" else "cuda_ipc")
            print("engine mapping read-only:", report["read_only"])  # as the driver allows
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
from protocol.errors import VerificationError
try:
    attach("tiny", Expectations.for_checkpoint(Path(sys.argv[2]), torch.device("cuda", 0)),
           config=ClientConfig(url=sys.argv[1]))
except VerificationError as exc:
    print(exc.reason)
"""


@pytest.mark.parametrize("handles", ["fd", "ipc"])
@pytest.mark.parametrize("engine", ["refused", "attached"])
def test_unloading_frees_the_gpu_memory_engines_let_go(
    tmp_path: Path, tiny_fp8: Path, tiny_pc: Path, engine: str, handles: str
) -> None:
    """Legacy IPC: every export counts one consumer in torch's IPC reference count; an engine
    that attached and exited, or one that refused the lease without opening it, must both hand
    their count back, or the daemon could never free the arena after an unload. Descriptors:
    the allocation is freed once the daemon, the engine and (here, none) the keeper let go."""
    settings = make_settings(tmp_path, [tiny_fp8], device="cuda:0", cuda_handles=handles)
    with InProcessDaemon(settings) as served:
        arena_bytes = served.daemon.model("tiny").bytes_resident
        loaded = torch.cuda.memory_allocated(0)
        free_loaded = torch.cuda.mem_get_info(0)[0]
        if engine == "refused":
            out = run_python(REFUSED_CHILD, served.url, str(tiny_pc)).stdout
            assert out.strip() == "fingerprint_mismatch"
        else:
            child = spawn_engine(served.url, tiny_fp8)
            assert child.stdin is not None and child.stdout is not None
            assert json.loads(child.stdout.readline())["zero_copy"]
            child.stdin.write("go\n")
            child.stdin.close()
            child.stdout.readline()
            assert child.wait(60) == 0
        assert served.daemon.leases.count() == 0
        allocation = getattr(served.daemon.model("tiny").ranks[0].arena, "allocation_size", 0)
        served.daemon.unload("tiny")
        torch.cuda.ipc_collect()
        if handles == "ipc":
            assert torch.cuda.memory_allocated(0) <= loaded - arena_bytes
        else:  # outside torch's pool: the driver's free memory grows by the allocation
            import gc

            gc.collect()
            assert allocation >= arena_bytes
            assert torch.cuda.mem_get_info(0)[0] >= free_loaded + allocation // 2


def test_verification_names_the_gpu_and_its_capability(tmp_path: Path, tiny_fp8: Path) -> None:
    """A CUDA lease verifies against this GPU; one naming another GPU, another compute
    capability, or leased to a CPU engine is refused with that reason."""
    from engine_client.arenas import release_unopened
    from engine_client.client import ClientConfig, DaemonClient
    from engine_client.verify import Expectations, verify_grant
    from protocol.errors import VerificationError

    with InProcessDaemon(make_settings(tmp_path, [tiny_fp8], device="cuda:0")) as served:
        with DaemonClient(ClientConfig(url=served.url)) as client:
            grant = client.lease("tiny", ttl_s=30)
            client.release(grant.lease.id)
        release_unopened(grant.arenas[0].handle)
    manifest = grant.full_manifest()
    on_gpu = Expectations.for_checkpoint(tiny_fp8, torch.device("cuda", 0))
    verify_grant(grant, on_gpu)
    device = manifest.device
    cases = {
        "capability_mismatch": device.model_copy(update={"compute_capability": "8.0"}),
        "device_mismatch": device.model_copy(update={"uuid": "GPU-00000000-0000"}),
    }
    for reason, other in cases.items():
        moved = grant.model_copy(update={"manifest": manifest.model_copy(update={"device": other})})
        with pytest.raises(VerificationError) as err:
            verify_grant(moved, on_gpu)
        assert err.value.reason == reason
    with pytest.raises(VerificationError) as err:
        verify_grant(grant, Expectations.for_checkpoint(tiny_fp8, torch.device("cpu")))
    assert err.value.reason == "device_mismatch"


def test_fd_arenas_live_outside_torchs_pool(tmp_path: Path, tiny_fp8: Path) -> None:
    """A descriptor-passed arena is a cuMemCreate allocation of its own: in no segment of
    torch's caching allocator (so emptying the cache after a load keeps it, and the daemon's
    footprint is its arenas plus its context)."""
    with InProcessDaemon(make_settings(tmp_path, [tiny_fp8], device="cuda:0")) as served:
        base = served.daemon.model("tiny").ranks[0].arena.base.data_ptr()
        segments = [
            s
            for s in torch.cuda.memory._snapshot()["segments"]
            if s["address"] <= base < s["address"] + s["total_size"]
        ]
    assert segments == []


def test_arenas_are_never_expandable_segments(tmp_path: Path, tiny_fp8: Path) -> None:
    """With legacy IPC, even with expandable segments turned on in the daemon's process, its
    arenas are plain allocations (opening an expandable segment over IPC costs time in
    proportion to its size)."""
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    configure = set_settings or torch.cuda.memory._set_allocator_settings
    configure("expandable_segments:True")
    torch.cuda.empty_cache()  # no cached plain block the arena could reuse
    try:
        settings = make_settings(tmp_path, [tiny_fp8], device="cuda:0", cuda_handles="ipc")
        with InProcessDaemon(settings) as served:
            base = served.daemon.model("tiny").ranks[0].arena.base.data_ptr()
            segments = [
                s
                for s in torch.cuda.memory._snapshot()["segments"]
                if s["address"] <= base < s["address"] + s["total_size"]
            ]
    finally:
        configure("expandable_segments:False")
    assert len(segments) == 1 and segments[0]["is_expandable"] is False


TWO_GPU_CHILD = """
import json, sys
from pathlib import Path
import torch
from engine_client.attach import attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from protocol.errors import VerificationError
url, ckpt = sys.argv[1], Path(sys.argv[2])
out = {"visible": torch.cuda.device_count()}
for rank in (1, 0):
    expect = Expectations.for_checkpoint(
        ckpt, torch.device("cuda", 0), tp_rank=rank, tp_size=2, verify_checksums=True
    )
    try:
        with attach("tiny", expect, config=ClientConfig(url=url), keep_alive=False) as att:
            out[str(rank)] = {"zero_copy": att.zero_copy(), "tensors": len(att.tensors)}
    except VerificationError as exc:
        out[str(rank)] = exc.reason
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp_ranks_on_their_gpus_found_by_uuid(tmp_path: Path, tiny_fp8: Path) -> None:
    """``--device cuda`` puts rank r on GPU r. An engine that sees only GPU 1 (as its cuda:0)
    finds rank 1's arena by UUID and reads it intact, and refuses rank 0, on a GPU it cannot see.
    The inventory knows free memory for GPUs holding arenas."""
    from protocol.devices import cuda_uuid

    settings = make_settings(tmp_path, [tiny_fp8], device="cuda", tp_size=2)
    with InProcessDaemon(settings) as served:
        ranks = served.daemon.model("tiny").ranks
        assert [r.arena.device.index for r in ranks] == [0, 1]
        assert [r.arena.device.uuid for r in ranks] == [cuda_uuid(0), cuda_uuid(1)]
        inventory = served.daemon.inventory()
        assert all(d.free_memory is not None for d in inventory.devices[:2])
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": cuda_uuid(1)}
        out = run_python(TWO_GPU_CHILD, served.url, str(tiny_fp8), timeout=180, env=env).stdout
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["visible"] == 1
        assert seen["1"]["zero_copy"] and seen["1"]["tensors"] == len(ranks[1].manifest.tensors)
        assert seen["0"] == "device_mismatch"
        assert served.daemon.leases.count() == 0

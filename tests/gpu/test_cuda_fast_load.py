"""On the GPU: the load path through pinned buffers and asynchronous copies gives the reference
path's bytes (``tests/reference_processing.py``, on the host) in fresh CUDA tensors and in the
daemon's CUDA arenas, with the checksums of those bytes, also with staging buffers small enough
that every tensor takes many copies, and with two loads at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing import cuda_fill
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.devices import Placement
from protocol.schemas.manifest import DeviceKind
from service.memory.shm import ArenaDir
from service.registry.loader import LoadRequest
from tests.conftest import MODELOPT_EXPORTS
from tests.reference_processing import assert_load_matches_reference, reference_storages

pytestmark = pytest.mark.gpu


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _assert_cuda_load_matches(path: Path, tp: int, rank: int) -> None:
    plan, want = reference_storages(path, tp, rank)
    with Checkpoint.open(path) as ckpt:
        got = process_checkpoint(ckpt, plan_model(ckpt, tp, rank), "cuda")
    specs = {s.name: s for s in plan.specs}
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert tensor.is_cuda, name
        spec = specs[name]
        assert tensor.shape == spec.shape and tensor.stride() == spec.stride, name
        assert torch.equal(_raw(spec.storage_of(tensor)), _raw(want[name])), name


@pytest.mark.parametrize("export", MODELOPT_EXPORTS, ids=lambda p: p.name)
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 3)])
def test_cuda_load_of_real_exports_matches_the_reference(export: Path, tp: int, rank: int) -> None:
    _assert_cuda_load_matches(export, tp, rank)


@pytest.mark.parametrize("stage", [64, 4096, 1 << 20])
def test_small_staging_buffers_change_nothing(
    tiny_any: Path, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    """Chunks and device slices that end inside a row, a shard or a segment change nothing."""
    monkeypatch.setattr(cuda_fill, "STAGE_BYTES", stage)
    monkeypatch.setattr(cuda_fill, "DEVICE_SLICE_BYTES", max(64, stage // 2))
    for tp, rank in [(1, 0), (4, 2)]:
        _assert_cuda_load_matches(tiny_any, tp, rank)


def _cuda_request(path: Path, shm: Path, tp: int) -> LoadRequest:
    # every rank on GPU 0 is allowed here
    placements = [Placement(DeviceKind.cuda, 0)] * tp
    return LoadRequest.unmanaged("m", path, placements, ArenaDir.prepare(shm))


@pytest.mark.parametrize("tp", [1, 2])
def test_cuda_arenas_hold_the_reference_bytes(tiny_any: Path, tmp_path: Path, tp: int) -> None:
    assert_load_matches_reference(_cuda_request(tiny_any, tmp_path, tp), "cuda")


def test_two_cuda_loads_at_once(tiny_fp8: Path, tiny_pc: Path) -> None:
    paths = [tiny_fp8, tiny_pc]
    results: list[dict[str, torch.Tensor] | None] = [None, None]

    def load(i: int) -> None:
        with Checkpoint.open(paths[i]) as ckpt:
            results[i] = process_checkpoint(ckpt, plan_model(ckpt), "cuda")

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for path, got in zip(paths, results, strict=True):
        assert got is not None
        plan, want = reference_storages(path, 1, 0)
        specs = {s.name: s for s in plan.specs}
        for name, tensor in got.items():
            assert torch.equal(_raw(specs[name].storage_of(tensor)), _raw(want[name])), name

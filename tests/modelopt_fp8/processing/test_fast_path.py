"""The load path (preadv into place, chunked checks, code maps, checksums, shared pool) gives
byte for byte what the plain path gives (``tests/reference_processing.py``: whole tensors
read, copied, requantized and padded in torch, layer by layer), for ordinary loads and for the
daemon's shared-memory arenas, on every fixture checkpoint at TP 1, 2 and 4."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from harness.checkpoint_tools import rewrite_tensors
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing import fill as fill_module
from modelopt_fp8.processing.execute import plan_jobs, process_checkpoint
from modelopt_fp8.processing.fill import run_jobs
from modelopt_fp8.processing.fp8 import FP8_DTYPE, CodeMap, requantize_lut
from modelopt_fp8.processing.integrity import any_non_finite, has_non_finite
from modelopt_fp8.processing.plan import ModelPlan, plan_model
from modelopt_fp8.processing.pool import shared_pool
from modelopt_fp8.processing.rows import RowFill
from modelopt_fp8.processing.source import SourceFiles, read_into
from modelopt_fp8.schemes.fp8 import requantize_maps
from protocol.checksum import storage_checksum
from protocol.devices import Placement
from protocol.errors import CorruptFileError
from protocol.schemas.manifest import DeviceKind
from service.demo import write_demo_checkpoint
from service.memory.shm import ArenaDir
from service.registry.loader import LoadRequest, Progress, load_model
from tests.conftest import MODELOPT_EXPORTS
from tests.reference_processing import assert_load_matches_reference, reference_storages

TP_RANKS = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_fast_matches_reference(path: Path, tp: int, rank: int) -> None:
    plan, want = reference_storages(path, tp, rank)
    with Checkpoint.open(path) as ckpt:
        got = process_checkpoint(ckpt, plan_model(ckpt, tp, rank))
    specs = {s.name: s for s in plan.specs}
    assert set(got) == set(want)
    for name, tensor in got.items():
        spec = specs[name]
        assert tensor.shape == spec.shape and tensor.stride() == spec.stride, name
        assert torch.equal(_raw(spec.storage_of(tensor)), _raw(want[name])), name


def shm_request(path: Path, shm: Path, tp: int) -> LoadRequest:
    return LoadRequest.unmanaged("m", path, [Placement(DeviceKind.cpu)] * tp, ArenaDir.prepare(shm))


def assert_arena_matches_reference(path: Path, shm: Path, tp: int) -> None:
    """The daemon's load (pwrite into shared-memory arenas): the bytes of every rank and the
    manifest's checksums are the reference path's."""
    assert_load_matches_reference(shm_request(path, shm, tp), "cpu")


@pytest.mark.parametrize("export", MODELOPT_EXPORTS, ids=lambda p: p.name)
@pytest.mark.parametrize(("tp", "rank"), TP_RANKS)
def test_real_exports_match_the_reference_path(export: Path, tp: int, rank: int) -> None:
    assert_fast_matches_reference(export, tp, rank)


@pytest.mark.parametrize(("tp", "rank"), TP_RANKS)
def test_demo_checkpoints_match_the_reference_path(tiny_any: Path, tp: int, rank: int) -> None:
    assert_fast_matches_reference(tiny_any, tp, rank)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_daemon_arenas_match_the_reference_path(tiny_any: Path, tmp_path: Path, tp: int) -> None:
    assert_arena_matches_reference(tiny_any, tmp_path, tp)


@pytest.mark.parametrize("export", MODELOPT_EXPORTS, ids=lambda p: p.name)
def test_daemon_arenas_of_real_exports_match(export: Path, tmp_path: Path) -> None:
    assert_arena_matches_reference(export, tmp_path, 2)


@pytest.mark.parametrize("chunk", [64, 300, 1000])
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (4, 1)])
def test_chunks_smaller_than_rows_and_segments(
    tiny_any: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, tp: int, rank: int
) -> None:
    """Chunks that end inside a row, inside a shard, and between shards change nothing."""
    monkeypatch.setattr(fill_module, "HOST_CHUNK_BYTES", chunk)
    monkeypatch.setattr(fill_module, "IN_PLACE_CHUNK_BYTES", chunk)
    monkeypatch.setattr(CodeMap, "SLICE", 7)
    assert_fast_matches_reference(tiny_any, tp, rank)


def test_sharded_checkpoint_files(tmp_path: Path) -> None:
    """Tensors spread over several files with an index."""
    path = write_demo_checkpoint(tmp_path / "sharded", "fp8", "tiny", shard_bytes=20_000)
    assert len(list(path.glob("*.safetensors"))) > 3
    assert_fast_matches_reference(path, 2, 1)
    assert_arena_matches_reference(path, tmp_path, 2)


def _set_scales(path: Path, scales: dict[str, float]) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        for name, value in scales.items():
            t[name] = torch.tensor(value, dtype=torch.float32)

    rewrite_tensors(path, edit)


QKV = "model.layers.0.self_attn"
GATE_UP = "model.layers.1.mlp"


def test_equal_shard_scales_are_copied_unchanged(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    _set_scales(path, {f"{QKV}.{p}_proj.weight_scale": 0.01 for p in "qkv"})
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt)
        jobs = plan_jobs(ckpt, plan)
    qkv = jobs[0].fills()[0]
    assert isinstance(qkv, RowFill)
    assert [s.source.code_map for s in qkv.segments] == [None, None, None]
    assert_fast_matches_reference(path, 1, 0)


def test_unequal_scales_requantize_all_but_identity_maps(tiny_fp8: Path, copy_of) -> None:
    """The shard at the max scale keeps its bytes (its map is the identity); the others are
    mapped; the result is the reference's."""
    path = copy_of(tiny_fp8)
    _set_scales(
        path,
        {
            f"{QKV}.q_proj.weight_scale": 0.003,
            f"{QKV}.k_proj.weight_scale": 0.007,
            f"{QKV}.v_proj.weight_scale": 0.0011,
            f"{GATE_UP}.gate_proj.weight_scale": 0.02,
            f"{GATE_UP}.up_proj.weight_scale": 0.0199,
        },
    )
    with Checkpoint.open(path) as ckpt:
        jobs = plan_jobs(ckpt, plan_model(ckpt))
    qkv = jobs[0].fills()[0]
    assert isinstance(qkv, RowFill)
    maps = [s.source.code_map for s in qkv.segments]
    assert maps[0] is not None and maps[1] is None and maps[2] is not None
    for tp, rank in TP_RANKS:
        assert_fast_matches_reference(path, tp, rank)


def test_max_scale_map_that_is_not_the_identity_is_applied() -> None:
    """With a tiny max scale, the float16 round trip flushes the smallest codes to zero, so
    even the max-scale shard changes: its map must not be skipped."""
    max_scale, maps = requantize_maps([torch.tensor(1e-6), torch.tensor(4e-7)])
    assert float(max_scale) == pytest.approx(1e-6)
    assert all(m is not None and not m.identity for m in maps)
    first = maps[0]
    assert first is not None
    assert first.table[1] == 0  # the smallest e4m3 subnormal at scale 1e-6 underflows float16


def test_max_scale_underflow_matches_the_reference(tiny_fp8: Path, copy_of) -> None:
    path = copy_of(tiny_fp8)
    _set_scales(
        path,
        {
            f"{QKV}.q_proj.weight_scale": 1e-6,
            f"{QKV}.k_proj.weight_scale": 5e-7,
            f"{QKV}.v_proj.weight_scale": 3e-7,
        },
    )

    def every_code(t: dict[str, torch.Tensor]) -> None:  # q (the max scale) holds every code
        name = f"{QKV}.q_proj.weight"
        codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
        flat = codes.repeat(t[name].numel() // codes.numel() + 1)[: t[name].numel()]
        t[name] = flat.view(FP8_DTYPE).reshape(t[name].shape)

    rewrite_tensors(path, every_code)
    assert_fast_matches_reference(path, 1, 0)
    assert_fast_matches_reference(path, 4, 2)


@settings(max_examples=40, deadline=None)
@given(
    scale=st.floats(1e-7, 10.0),
    ratio=st.floats(0.01, 1.0),
    size=st.integers(0, 600),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_code_map_is_the_table(
    scale: float, ratio: float, size: int, strided: bool, seed: int
) -> None:
    lut = requantize_lut(torch.tensor(scale * ratio), torch.tensor(scale))
    code_map = CodeMap(lut)
    src = np.random.default_rng(seed).integers(0, 256, size * 2 + 1, dtype=np.uint8)
    src = src[1:] if size % 2 else src[:-1]  # odd addresses and sizes too
    out = np.full((2, src.size), 0xAA, dtype=np.uint8)
    dst = out[0, ::-1] if strided else out[0]
    code_map.apply(src, dst)
    assert np.array_equal(dst, lut.numpy()[src])
    assert (out[1] == 0xAA).all()


FLOATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32]


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    data=st.binary(min_size=8, max_size=64),
    special=st.sampled_from([None, float("nan"), float("inf"), -float("inf"), 448.0, -0.0]),
    where=st.integers(0, 7),
)
def test_non_finite_check_agrees_with_torch(
    dtype: torch.dtype, data: bytes, special: float | None, where: int
) -> None:
    raw = np.frombuffer(data[: len(data) - len(data) % 8], dtype=np.uint8).copy()
    tensor = torch.from_numpy(raw).view(dtype)
    if special is not None and tensor.numel():
        tensor[where % tensor.numel()] = special  # e4m3 has no infinity: inf becomes NaN
    expected = bool((~torch.isfinite(tensor.float())).any())
    assert has_non_finite(tensor.view(torch.uint8).numpy(), dtype) == expected
    # The GPU's form of the same test (device operations, here on the host), on a padded
    # [rows, width] region as the GPU path checks it: the padding beside it is not looked at.
    rows = tensor.view(torch.uint8).reshape(2, -1)
    padded = torch.full((2, rows.shape[1] + 8), 0xFF, dtype=torch.uint8)
    padded[:, : rows.shape[1]] = rows
    found = any_non_finite(padded[:, : rows.shape[1]], dtype)
    assert found is not None and bool(found) == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_in_a_requantized_shard_is_refused(tiny_fp8: Path, copy_of, device: str) -> None:
    """The check sees the bytes before the code map (which sends NaN to 448)."""
    path = copy_of(tiny_fp8)
    name = f"{QKV}.v_proj.weight"

    def corrupt(t: dict[str, torch.Tensor]) -> None:
        w = t[name].clone()
        w.view(torch.uint8)[3, 5] = 0xFF
        t[name] = w

    rewrite_tensors(path, corrupt)
    with Checkpoint.open(path) as ckpt:
        jobs = plan_jobs(ckpt, plan_model(ckpt))
        qkv = jobs[0].fills()[0]
        assert isinstance(qkv, RowFill)
        assert qkv.segments[2].source.code_map is not None
        with pytest.raises(CorruptFileError) as err:
            process_checkpoint(ckpt, plan_model(ckpt), device)
    assert err.value.extra["tensor"] == name


def test_file_truncated_after_opening_is_refused(tiny_pc: Path, copy_of) -> None:
    path = copy_of(tiny_pc)
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt)
        file = path / "model.safetensors"
        os.truncate(file, file.stat().st_size - 100)
        with pytest.raises(CorruptFileError) as err:
            process_checkpoint(ckpt, plan)
    assert "early" in err.value.detail


def test_failed_arena_load_leaves_no_file(tiny_fp8: Path, copy_of, tmp_path: Path) -> None:
    path = copy_of(tiny_fp8)

    def corrupt(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = torch.full_like(t["model.norm.weight"], float("inf"))

    rewrite_tensors(path, corrupt)
    shm = tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(CorruptFileError):
        load_model(shm_request(path, shm, 2), Progress())
    assert [p for p in shm.rglob("*") if not p.is_dir()] == []  # the private dir stays, empty


def test_read_into_scatters_and_reports_short_reads(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_bytes(bytes(range(200)))
    a, b, c = bytearray(3), bytearray(0), bytearray(5)
    fd = os.open(file, os.O_RDONLY)
    try:
        assert read_into(fd, 10, [memoryview(a), memoryview(b), memoryview(c)]) == 8
        assert bytes(a) == bytes(range(10, 13)) and bytes(c) == bytes(range(13, 18))
        many = [memoryview(bytearray(1)) for _ in range(3000)]  # more than IOV_MAX
        assert read_into(fd, 0, many) == 200
        assert bytes(m[0] for m in many[:200]) == bytes(range(200))
        tail = bytearray(10)
        assert read_into(fd, 195, [memoryview(tail)]) == 5
    finally:
        os.close(fd)


def test_source_read_outside_a_tensor_is_refused(tiny_fp8: Path) -> None:
    with Checkpoint.open(tiny_fp8) as ckpt, SourceFiles(ckpt.files) as src:
        name = "model.norm.weight"
        n = src.extent(name).nbytes
        with pytest.raises(ValueError):
            src.read(name, n - 1, [memoryview(bytearray(2))])


# --- the shared pool -----------------------------------------------------------------------------


@pytest.fixture
def two_plans(tiny_fp8: Path, tiny_pc: Path) -> Iterator[list[tuple[Checkpoint, ModelPlan]]]:
    ckpts = [Checkpoint.open(tiny_fp8), Checkpoint.open(tiny_pc)]
    yield [(c, plan_model(c, 2, 1)) for c in ckpts]
    for c in ckpts:
        c.close()


def _run(ckpt: Checkpoint, plan: ModelPlan, progress: Callable[[int, int], None] | None = None):
    storages = {s.name: torch.empty(s.storage_shape, dtype=s.dtype) for s in plan.specs}
    with SourceFiles(ckpt.files) as src:
        sums = run_jobs(src, plan_jobs(ckpt, plan), dict(storages), progress)
    return storages, sums


def test_loads_at_once_share_the_pool_and_get_the_same_bytes(two_plans) -> None:
    alone = [_run(c, p) for c, p in two_plans]
    together: list = [None, None]

    def load(i: int) -> None:
        together[i] = _run(*two_plans[i])

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (storages, sums), (want, want_sums) in zip(together, alone, strict=True):
        assert sums == want_sums
        for name, tensor in storages.items():
            assert torch.equal(_raw(tensor), _raw(want[name])), name
            assert sums[name] == storage_checksum(tensor)
    pool, workers = shared_pool()
    assert workers >= 1 and pool._max_workers == workers


def test_progress_that_raises_stops_the_load(two_plans, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelling (a progress callback that raises) stops the jobs under way before it
    returns, so the caller can free the destinations."""
    ckpt, plan = two_plans[0]
    seen: list[int] = []
    active = [0, 0]  # running now, most at once
    lock = threading.Lock()
    run_job = fill_module._run_job

    def counted(*args, **kwargs):
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
        try:
            return run_job(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(fill_module, "_run_job", counted)

    class Cancelled(Exception):
        pass

    def progress(nbytes: int, ntensors: int) -> None:
        seen.append(nbytes)
        if len(seen) == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        _run(ckpt, plan, progress)
    assert len(seen) == 2
    assert active[0] == 0  # nothing left writing
    _, workers = shared_pool()
    assert 1 <= active[1] <= workers  # never more jobs at once than the pool has workers
    assert len(plan_jobs(ckpt, plan)) > 2 + workers  # so the rest were never started

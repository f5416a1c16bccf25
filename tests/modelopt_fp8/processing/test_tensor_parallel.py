"""Rank slices as vLLM's parallel linear loaders cut them."""

from __future__ import annotations

import pytest

from modelopt_fp8.checkpoint.architecture import ModelDims, linear_specs
from modelopt_fp8.processing.tensor_parallel import check_tp_size, shard_slice
from protocol.errors import TensorParallelError

DIMS = ModelDims("LlamaForCausalLM", 64, 84, 4, 2, 16, 1, 256, False, False, False)
QKV, O_PROJ, GATE_UP, DOWN = linear_specs(DIMS)


def slices(spec, tp: int, rank: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [(s.rows, s.cols) for s in (shard_slice(spec, sh, DIMS, tp, rank) for sh in spec.shards)]


def test_tp1_is_whole() -> None:
    assert slices(QKV, 1, 0) == [((0, 64), (0, 64)), ((0, 32), (0, 64)), ((0, 32), (0, 64))]
    assert slices(DOWN, 1, 0) == [((0, 64), (0, 84))]


def test_tp2_splits_heads_evenly() -> None:
    assert slices(QKV, 2, 1) == [((32, 64), (0, 64)), ((16, 32), (0, 64)), ((16, 32), (0, 64))]
    assert slices(GATE_UP, 2, 1) == [((42, 84), (0, 64)), ((42, 84), (0, 64))]
    assert slices(O_PROJ, 2, 1) == [((0, 64), (32, 64))]
    assert slices(DOWN, 2, 0) == [((0, 64), (0, 42))]


@pytest.mark.parametrize(("rank", "kv_head"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_tp4_replicates_kv_heads(rank: int, kv_head: int) -> None:
    q, k, v = slices(QKV, 4, rank)
    assert q == ((rank * 16, rank * 16 + 16), (0, 64))
    assert k == v == ((kv_head * 16, kv_head * 16 + 16), (0, 64))
    assert slices(DOWN, 4, rank) == [((0, 64), (rank * 21, rank * 21 + 21))]


@pytest.mark.parametrize("tp", [0, 3, 8])
def test_indivisible_sizes(tp: int) -> None:
    with pytest.raises(TensorParallelError):
        check_tp_size(DIMS, tp)

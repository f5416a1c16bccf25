"""The plain path the fast path is compared with byte for byte: whole tensors read one at a time,
checked for NaN and infinity with torch reductions, then each layer processed in plain torch
(:func:`harness.plain_processing.process_layer`: fused, padded, and its scheme's
``process_in_torch``), one layer after another in one thread.

It shares the plan (what is held, and where) with the fast path, and nothing of how it is filled:
no row segments, no code maps applied by the loading pool, no checksums. The vLLM arithmetic
itself (``requantize_lut``) is checked independently by ``tests/vllm_reference.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from harness.plain_processing import process_layer
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.carried_plan import CarriedPlan
from modelopt_fp8.processing.fp8 import FP8_DTYPE
from modelopt_fp8.processing.linear_plan import LinearPlan
from modelopt_fp8.processing.plan import ModelPlan, plan_model
from protocol.checksum import storage_checksum
from protocol.errors import CorruptFileError
from service.registry.loader import LoadRequest, Progress, load_model

_E4M3_NAN_BITS = 0x7F
_CHUNK = 1 << 22  # elements per reduction: keeps the masked temporary in cache


def _has_e4m3_nan(tensor: torch.Tensor) -> bool:
    codes = tensor.reshape(-1).view(torch.uint8)
    for start in range(0, codes.numel(), _CHUNK):
        if int(codes[start : start + _CHUNK].bitwise_and(_E4M3_NAN_BITS).max()) == 0x7F:
            return True
    return False


def _has_non_finite(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0:
        return False
    low, high = torch.aminmax(tensor.reshape(-1))
    return not (math.isfinite(float(low)) and math.isfinite(float(high)))


def require_finite(tensor: torch.Tensor, name: str, file: str) -> None:
    if tensor.dtype == FP8_DTYPE:
        bad = tensor.numel() > 0 and _has_e4m3_nan(tensor)
    elif tensor.is_floating_point():
        bad = _has_non_finite(tensor)
    else:
        return
    if bad:
        raise CorruptFileError("tensor data holds NaN or infinite values", file=file, tensor=name)


def _read_clean(
    ckpt: Checkpoint,
    name: str,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    tensor = ckpt.read(name, rows=rows, cols=cols)
    require_finite(tensor, name, str(ckpt.tensors[name].file))
    return tensor


def read_shards(ckpt: Checkpoint, plan: LinearPlan) -> list[torch.Tensor]:
    """This rank's rows of every shard's weight of a planned layer."""
    return [_read_clean(ckpt, s.weight, rows=s.slice.rows, cols=s.slice.cols) for s in plan.shards]


def _linear(
    ckpt: Checkpoint, plan: LinearPlan, scales: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    weights = read_shards(ckpt, plan)
    out = process_layer(plan.scheme, plan, weights, plan.shard_scales(scales))
    if plan.bias is not None:  # the shards' rows one after another, never padded
        biases = [_read_clean(ckpt, s.bias or "", rows=s.slice.rows) for s in plan.shards]
        out[plan.bias.name] = torch.cat(biases)
    return out


def _carried(ckpt: Checkpoint, plan: CarriedPlan) -> torch.Tensor:
    """As stored, or (embeddings, LM head) this rank's vocabulary rows then zero rows."""
    if plan.rows is None:
        return _read_clean(ckpt, plan.source)
    storage = torch.zeros(plan.spec.storage_shape, dtype=plan.spec.dtype)
    count = plan.rows[1] - plan.rows[0]
    if count:
        storage[:count] = _read_clean(ckpt, plan.source, rows=plan.rows)
    return storage


def reference_storages(path: Path, tp: int, rank: int) -> tuple[ModelPlan, dict[str, torch.Tensor]]:
    """Every processed storage of ``rank`` as the plain path makes it, by tensor name."""
    storages: dict[str, torch.Tensor] = {}
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt, tp, rank)
        for lp in plan.linears:
            storages.update(_linear(ckpt, lp, plan.scales))
        for cp in plan.carried:
            storages[cp.spec.name] = _carried(ckpt, cp)
    return plan, storages


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A storage's bytes, on the host."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_load_matches_reference(request: LoadRequest, device_type: str) -> None:
    """The daemon's load of ``request``: every rank's arena on ``device_type``, its bytes and
    the manifest's checksums the plain path's."""
    ranks = load_model(request, Progress())
    try:
        for rank in ranks:
            plan, want = reference_storages(request.path, request.tp_size, rank.manifest.tp_rank)
            specs = {s.name: s for s in plan.specs}
            for entry in rank.manifest.tensors:
                stored = rank.arena.storage(specs[entry.name])
                assert stored.device.type == device_type, entry.name
                assert torch.equal(storage_bytes(stored), storage_bytes(want[entry.name]))
                assert entry.checksum == storage_checksum(want[entry.name]), entry.name
    finally:
        for rank in ranks:
            rank.arena.release()

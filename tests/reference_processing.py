"""The load path as it was before the fast path: read each shard through ``safetensors``, copy,
check, requantize with a byte table, pad, one layer after another in one thread.

Kept verbatim (apart from the helpers it used being inlined here) as the reference the fast path
in ``modelopt_fp8.processing.execute`` is compared with byte for byte. The vLLM arithmetic itself
(``requantize_lut``) is shared: ``tests/vllm_reference.py`` checks it independently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing import CarriedPlan, LinearPlan, ModelPlan, TensorSpec, plan_model
from modelopt_fp8.processing.fp8 import FP8_DTYPE, requantize_lut
from protocol.errors import CorruptFileError
from protocol.schemas.layout import Scheme

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


_LUT_CHUNK = 1 << 22  # elements per gather: bounds each temporary to 4 MiB


def apply_code_lut(weight: torch.Tensor, lut: torch.Tensor) -> None:
    """Replace every e4m3 code of the CPU tensor ``weight`` (2-D) in place by ``lut[code]``.

    NumPy releases the GIL while it gathers, so row blocks run in parallel threads, as many as
    torch's intra-op setting allows.
    """
    codes = weight.view(torch.uint8).numpy()
    table = lut.numpy()
    rows_per_chunk = max(1, _LUT_CHUNK // max(1, codes.shape[1]))
    blocks = [codes[i : i + rows_per_chunk] for i in range(0, codes.shape[0], rows_per_chunk)]

    def gather(block: np.ndarray) -> None:
        block[...] = table[block]

    if len(blocks) == 1 or torch.get_num_threads() == 1:
        for block in blocks:
            gather(block)
        return
    with ThreadPoolExecutor(max_workers=min(len(blocks), torch.get_num_threads())) as pool:
        list(pool.map(gather, blocks))


# Hands out contiguous storage (shape ``spec.storage_shape``, dtype ``spec.dtype``) to write into.
StorageFor = Callable[[TensorSpec], torch.Tensor]
OnProgress = Callable[[int, int], None]  # (bytes written, tensors written) since the last call


@dataclass(frozen=True)
class ShardData:
    """One checkpoint shard's tensors, already cut to this rank's slice."""

    weight: torch.Tensor  # [rows, K] e4m3 (or the model dtype when unquantized)
    weight_scale: torch.Tensor | None = None  # 0-dim/[1] (FP8) or [rows] (per channel)
    input_scale: torch.Tensor | None = None  # 0-dim/[1] (FP8 only)
    bias: torch.Tensor | None = None  # [rows]


@dataclass(frozen=True)
class LinearOutputs:
    """Where a processed layer goes: ``weight`` is the ``[N_pad, K_pad]`` row-major storage
    behind the ``[K_pad, N_pad]`` view (``[N, K]`` when unquantized)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def process_linear(scheme: Scheme, shards: Sequence[ShardData], out: LinearOutputs) -> None:
    """Fuse, requantize and pad one layer's shards into ``out``, as vLLM 0.33 does."""
    n = sum(s.weight.shape[0] for s in shards)
    k = shards[0].weight.shape[1]
    weight = out.weight
    if weight.shape[0] > n:
        weight[n:].zero_()
    if weight.shape[1] > k:
        weight[:n, k:].zero_()
    ranges: list[tuple[int, int]] = []
    row = 0
    for shard in shards:
        rows = shard.weight.shape[0]
        weight[row : row + rows, :k].copy_(shard.weight)
        ranges.append((row, row + rows))
        row += rows

    if scheme is Scheme.fp8:
        assert out.weight_scale is not None and out.input_scale is not None
        shard_scales = torch.stack([_scalar(s.weight_scale) for s in shards])
        max_scale = shard_scales.max()
        if not bool((shard_scales == shard_scales[0]).all()):
            for (start, end), scale in zip(ranges, shard_scales, strict=True):
                apply_code_lut(weight[start:end, :k], requantize_lut(scale, max_scale))
        out.weight_scale.copy_(max_scale)
        out.input_scale.copy_(torch.stack([_scalar(s.input_scale) for s in shards]).max())
    elif scheme is Scheme.fp8_pc_pt:
        assert out.weight_scale is not None
        for shard, (start, end) in zip(shards, ranges, strict=True):
            assert shard.weight_scale is not None
            out.weight_scale[start:end].copy_(shard.weight_scale.reshape(-1))
        out.weight_scale[n:].fill_(1.0)

    if out.bias is not None:
        out.bias.copy_(torch.cat([s.bias for s in shards if s.bias is not None]))


def _scalar(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None, "FP8 shards carry per-tensor scales"
    return t.reshape(()).to(torch.float32)


def read_shards(
    ckpt: Checkpoint, plan: LinearPlan, scales: dict[str, torch.Tensor]
) -> list[ShardData]:
    """This rank's slice of every shard of a planned layer."""
    shards = []
    for src in plan.shards:
        sl = src.slice
        weight_scale = scales[src.weight_scale] if src.weight_scale else None
        if weight_scale is not None and weight_scale.numel() > 1:  # per channel: this rank's rows
            weight_scale = weight_scale.reshape(-1)[sl.rows[0] : sl.rows[1]]
        weight = _read_clean(ckpt, src.weight, rows=sl.rows, cols=sl.cols)
        bias = _read_clean(ckpt, src.bias, rows=sl.rows) if src.bias else None
        shards.append(
            ShardData(
                weight=weight,
                weight_scale=weight_scale,
                input_scale=scales[src.input_scale] if src.input_scale else None,
                bias=bias,
            )
        )
    return shards


def _read_clean(
    ckpt: Checkpoint,
    name: str,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    tensor = ckpt.read(name, rows=rows, cols=cols)
    require_finite(tensor, name, str(ckpt.tensors[name].file))
    return tensor


def fill_linear(
    ckpt: Checkpoint, plan: LinearPlan, scales: dict[str, torch.Tensor], storage_for: StorageFor
) -> None:
    """Read, process and write one planned linear layer."""

    def get(spec: TensorSpec | None) -> torch.Tensor | None:
        return storage_for(spec) if spec is not None else None

    out = LinearOutputs(
        storage_for(plan.weight), get(plan.weight_scale), get(plan.input_scale), get(plan.bias)
    )
    process_linear(plan.layout.scheme, read_shards(ckpt, plan, scales), out)


def fill_carried(ckpt: Checkpoint, plan: CarriedPlan, storage_for: StorageFor) -> None:
    """As stored, or (embeddings, LM head) this rank's vocabulary rows then zero rows."""
    storage = storage_for(plan.spec)
    rows = plan.rows
    if rows is None:
        storage.copy_(_read_clean(ckpt, plan.source))
        return
    count = rows[1] - rows[0]
    if count:
        storage[:count].copy_(_read_clean(ckpt, plan.source, rows=rows))
    storage[count:].zero_()


def execute_plan(
    ckpt: Checkpoint, plan: ModelPlan, storage_for: StorageFor, progress: OnProgress | None = None
) -> None:
    """Process every layer of ``plan`` into storage from ``storage_for``."""
    for lp in plan.linears:
        fill_linear(ckpt, lp, plan.scales, storage_for)
        if progress:
            progress(sum(s.nbytes for s in lp.specs), len(lp.specs))
    for cp in plan.carried:
        fill_carried(ckpt, cp, storage_for)
        if progress:
            progress(cp.spec.nbytes, 1)


def process_checkpoint(
    ckpt: Checkpoint,
    plan: ModelPlan,
    device: torch.device | str = "cpu",
    progress: OnProgress | None = None,
) -> dict[str, torch.Tensor]:
    """An ordinary load: every processed tensor in its own fresh allocation on ``device``.

    This is what an engine without the daemon does, through the same code as the daemon.
    """
    device = torch.device(device)
    storages: dict[str, torch.Tensor] = {}

    def storage_for(spec: TensorSpec) -> torch.Tensor:
        storage = storages.get(spec.name)
        if storage is None:
            storage = torch.empty(spec.storage_shape, dtype=spec.dtype)
            storages[spec.name] = storage
        return storage

    execute_plan(ckpt, plan, storage_for, progress)
    specs = {s.name: s for s in plan.specs}
    return {
        name: specs[name].view(storage.to(device) if device.type != "cpu" else storage)
        for name, storage in storages.items()
    }


def reference_storages(path: Path, tp: int, rank: int) -> tuple[ModelPlan, dict[str, torch.Tensor]]:
    """Every processed storage of ``rank`` as the reference path makes it."""
    with Checkpoint.open(path) as ckpt:
        plan = plan_model(ckpt, tp, rank)
        tensors = process_checkpoint(ckpt, plan)
    specs = {s.name: s for s in plan.specs}
    return plan, {name: specs[name].storage_of(t) for name, t in tensors.items()}

"""Carrying out a plan: read each shard, fuse, requantize, pad, and write the result into the
storage the caller hands out (an arena slot in the daemon, a fresh tensor in an ordinary load).

Each step mirrors vLLM 0.33 (file:line in the vLLM 0.33.0 wheel):

* fuse shards along the output dim: what the fused ``weight_loader_v2`` does into one buffer;
* FP8 weight scale: ``max_w_scale = weight_scale.max()``, and when the shard scales differ,
  ``requantize_with_max_scale`` (``quantization/modelopt.py:2187-2191``,
  ``quantization/utils/w8a8_utils.py:75-105``);
* the ``[K, N]`` view ``weight.t()`` and ``processed_weight_dims = (0, 1)``
  (``modelopt.py:2194-2197``; per channel via ``fp8_utils.process_fp8_weight_channel_strategy``,
  ``modelopt.py:2244-2250``);
* FP8 input scale collapsed to its max (``modelopt.py:2206``);
* CUTLASS padding of K and N to 16 with zeros, per-channel scales with 1.0, and the logical width
  (``kernels/linear/scaled_mm/cutlass.py:205-233``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.fp8 import apply_code_lut, requantize_lut
from modelopt_fp8.processing.integrity import require_finite
from modelopt_fp8.processing.plan import CarriedPlan, LinearPlan, ModelPlan, TensorSpec
from protocol.schemas.layout import Scheme

# Hands out contiguous storage (shape ``spec.storage_shape``, dtype ``spec.dtype``) to write into.
StorageFor = Callable[[TensorSpec], torch.Tensor]
Progress = Callable[[int, int], None]  # (bytes written, tensors written) since the last call


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
    """Write one carried tensor as vLLM holds it: as stored, or (embeddings, LM head) this
    rank's vocabulary rows followed by zero rows up to the padded size."""
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
    ckpt: Checkpoint, plan: ModelPlan, storage_for: StorageFor, progress: Progress | None = None
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


def load_processed(
    ckpt: Checkpoint,
    plan: ModelPlan,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
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

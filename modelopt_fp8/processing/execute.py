"""Carrying out a plan: read each shard, fuse, requantize, pad, and write the result into the
storage the caller hands out (an arena slot in the daemon, a fresh tensor in an ordinary load).

Each step mirrors vLLM 0.33 (functions of the vLLM 0.33.0 wheel):

* fuse shards along the output dim: what the fused ``weight_loader_v2`` does into one buffer;
* FP8 weight scale: ``max_w_scale = weight_scale.max()``, and when the shard scales differ,
  ``requantize_with_max_scale`` (``KFp8StaticTensor.process`` in ``quantization/modelopt.py``,
  and ``quantization/utils/w8a8_utils.requantize_with_max_scale``);
* the ``[K, N]`` view ``weight.t()`` and ``processed_weight_dims = (0, 1)`` (the same
  ``process``; per channel ``KFp8StaticChannel.process`` via
  ``fp8_utils.process_fp8_weight_channel_strategy``);
* FP8 input scale collapsed to its max (``KFp8StaticTensor.process``, its activation role);
* CUTLASS padding of K and N to 16 with zeros, per-channel scales with 1.0, and the logical width
  (``CutlassFP8ScaledMMLinearKernel.process_weights_after_loading`` in
  ``kernels/linear/scaled_mm/cutlass.py``).

How it runs: the ``[N_pad, K_pad]`` storage of a fused weight is its shards' rows one after
another, so each layer becomes a list of row segments of checkpoint tensors (with the code map
that requantizes each shard, where one is needed) and zeros around them; :mod:`.fill` carries
them out on the shared loading pool (on the GPU, :mod:`.cuda_fill`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.carried_plan import CarriedPlan
from modelopt_fp8.processing.fill import run_jobs
from modelopt_fp8.processing.fp8 import CodeMap, requantize_map
from modelopt_fp8.processing.linear_plan import LinearPlan
from modelopt_fp8.processing.plan import ModelPlan
from modelopt_fp8.processing.rows import (
    Destination,
    Fill,
    Job,
    OnProgress,
    RowFill,
    RowSource,
    Segment,
    SmallFill,
    storage_rows,
)
from modelopt_fp8.processing.source import SourceFiles
from modelopt_fp8.processing.tensor_spec import TensorSpec
from protocol.schemas.layout import Scheme

# Where each tensor's contiguous storage (shape ``spec.storage_shape``, dtype ``spec.dtype``) goes:
# a tensor (host or GPU memory) or a byte range of an arena file.
StorageFor = Callable[[TensorSpec], Destination]


def _scalar(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None, "FP8 shards carry per-tensor scales"
    return t.reshape(()).to(torch.float32)


def requantize_maps(
    shard_scales: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, list[CodeMap | None]]:
    """The fused FP8 layer's weight scale (the max) and, per shard, the code map that
    requantizes it, or None where its bytes stay as they are.

    vLLM requantizes every shard, the max-scale one included, as soon as any scale differs
    (its round trip through float16 may move a code); a map that is the identity is dropped,
    which leaves the same bytes.
    """
    scales = torch.stack([_scalar(s) for s in shard_scales])
    max_scale = scales.max()
    if bool((scales == scales[0]).all()):
        return max_scale, [None] * len(shard_scales)
    maps: list[CodeMap | None] = []
    for scale in scales:
        code_map = requantize_map(scale, max_scale)
        maps.append(None if code_map.identity else code_map)
    return max_scale, maps


def _channel_scales(scales: Iterable[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """Per-channel scales of the fused rows, padded with 1.0 to the storage's length."""
    parts = [s.reshape(-1).to(torch.float32) for s in scales if s is not None]
    out = torch.ones(like.shape, dtype=torch.float32)
    joined = torch.cat(parts)
    out[: joined.numel()] = joined
    return out


# --- what a load writes: row segments and small computed tensors --------------------------------


def linear_job(ckpt: Checkpoint, plan: LinearPlan, scales: dict[str, torch.Tensor]) -> Job:
    """One linear layer: the fused, requantized, padded weight and its scales and bias."""
    return Job(tuple(plan.specs), lambda: linear_fills(ckpt, plan, scales))


def linear_fills(
    ckpt: Checkpoint, plan: LinearPlan, scales: dict[str, torch.Tensor]
) -> tuple[Fill, ...]:
    scheme = plan.layout.scheme
    maps: list[CodeMap | None] = [None] * len(plan.shards)
    fills: list[Fill] = []
    if scheme is Scheme.fp8:
        max_scale, maps = requantize_maps([scales[s.weight_scale or ""] for s in plan.shards])
        input_scale = torch.stack([_scalar(scales[s.input_scale or ""]) for s in plan.shards])
        assert plan.weight_scale is not None and plan.input_scale is not None
        fills.append(SmallFill(plan.weight_scale, max_scale.clone))
        fills.append(SmallFill(plan.input_scale, input_scale.max))
    elif scheme is Scheme.fp8_pc_pt:
        assert plan.weight_scale is not None
        per_shard = [
            scales[s.weight_scale or ""].reshape(-1)[s.slice.rows[0] : s.slice.rows[1]]
            for s in plan.shards
        ]
        spec = plan.weight_scale
        fills.append(
            SmallFill(spec, lambda: _channel_scales(per_shard, torch.empty(spec.storage_shape)))
        )
    segments = []
    row = 0
    for shard, code_map in zip(plan.shards, maps, strict=True):
        info = ckpt.tensors[shard.weight]
        itemsize = info.dtype.itemsize
        cols = shard.slice.cols
        source = RowSource(
            tensor=shard.weight,
            file=str(info.file),
            dtype=info.dtype,
            row_bytes=info.shape[1] * itemsize,
            first_row=shard.slice.rows[0],
            cols=(cols[0] * itemsize, cols[1] * itemsize),
            code_map=code_map,
        )
        segments.append(Segment(row, shard.slice.width, source))
        row += shard.slice.width
    rows, row_bytes = storage_rows(plan.weight)
    fills.insert(0, RowFill(plan.weight, rows, row_bytes, tuple(segments)))
    if plan.bias is not None:
        fills.append(_bias_fill(ckpt, plan, plan.bias))
    return tuple(fills)


def _bias_fill(ckpt: Checkpoint, plan: LinearPlan, spec: TensorSpec) -> RowFill:
    """The fused bias: each shard's rows, one after another (never padded)."""
    segments = []
    row = 0
    for shard in plan.shards:
        assert shard.bias is not None
        info = ckpt.tensors[shard.bias]
        source = RowSource(
            tensor=shard.bias,
            file=str(info.file),
            dtype=info.dtype,
            row_bytes=info.dtype.itemsize,
            first_row=shard.slice.rows[0],
            cols=(0, info.dtype.itemsize),
        )
        segments.append(Segment(row, shard.slice.width, source))
        row += shard.slice.width
    rows, row_bytes = storage_rows(spec)
    return RowFill(spec, rows, row_bytes, tuple(segments))


def carried_job(ckpt: Checkpoint, plan: CarriedPlan) -> Job:
    """A tensor as vLLM holds it: as stored, or (embeddings, LM head) this rank's vocabulary
    rows followed by zero rows up to the padded size."""
    info = ckpt.tensors[plan.source]
    rows, row_bytes = storage_rows(plan.spec)
    first, count = (0, rows) if plan.rows is None else (plan.rows[0], plan.rows[1] - plan.rows[0])
    source = RowSource(
        tensor=plan.source,
        file=str(info.file),
        dtype=info.dtype,
        row_bytes=row_bytes,
        first_row=first,
        cols=(0, row_bytes),
    )
    segments = (Segment(0, count, source),) if count else ()
    fill = RowFill(plan.spec, rows, row_bytes, segments)
    return Job((plan.spec,), lambda: (fill,))


def plan_jobs(ckpt: Checkpoint, plan: ModelPlan) -> list[Job]:
    jobs = [linear_job(ckpt, lp, plan.scales) for lp in plan.linears]
    jobs.extend(carried_job(ckpt, cp) for cp in plan.carried)
    return jobs


def execute_plan(
    ckpt: Checkpoint, plan: ModelPlan, storage_for: StorageFor, progress: OnProgress | None = None
) -> dict[str, str]:
    """Process every layer of ``plan`` into storage from ``storage_for``; returns the xxh3
    checksum of every storage, by tensor name."""
    dests = {spec.name: storage_for(spec) for spec in plan.specs}
    with SourceFiles(
        ckpt.files, ckpt.descriptors()
    ) as src:  # the one place checkpoint files are opened for reads
        return run_jobs(src, plan_jobs(ckpt, plan), dests, progress)


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
    storages = {
        spec.name: torch.empty(spec.storage_shape, dtype=spec.dtype, device=device)
        for spec in plan.specs
    }
    execute_plan(ckpt, plan, lambda spec: storages[spec.name], progress)
    specs = {s.name: s for s in plan.specs}
    return {name: specs[name].view(storage) for name, storage in storages.items()}

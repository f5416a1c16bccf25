"""Carrying out a plan: read each shard, fuse, requantize, pad, and write the result into the
storage the caller hands out (an arena slot in the daemon, a fresh tensor in an ordinary load).

What every layer shares mirrors vLLM 0.33: the fused ``weight_loader_v2`` puts the shards' rows
one after another in one buffer, and the CUTLASS kernel's layout pads them with zeros
(:mod:`.cutlass`). What a quantization scheme adds, its fused scales and the requantization of
each shard, is the scheme's (:mod:`modelopt_fp8.schemes`, each naming the vLLM code it follows).

How it runs: the ``[N_pad, K_pad]`` storage of a fused weight is its shards' rows one after
another, so each layer becomes a list of row segments of checkpoint tensors (with the code map
that requantizes each shard, where one is needed) and zeros around them; :mod:`.fill` carries
them out on the shared loading pool (on the GPU, :mod:`.cuda_fill`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.carried_plan import CarriedPlan
from modelopt_fp8.processing.fill import run_jobs
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
    storage_rows,
)
from modelopt_fp8.processing.source import SourceFiles
from modelopt_fp8.processing.tensor_spec import TensorSpec

# Where each tensor's contiguous storage (shape ``spec.storage_shape``, dtype ``spec.dtype``) goes:
# a tensor (host or GPU memory) or a byte range of an arena file.
StorageFor = Callable[[TensorSpec], Destination]


# --- what a load writes: row segments and small computed tensors --------------------------------


def linear_job(ckpt: Checkpoint, plan: LinearPlan, scales: dict[str, torch.Tensor]) -> Job:
    """One linear layer: the fused, requantized, padded weight and its scales and bias."""
    return Job(tuple(plan.specs), lambda: linear_fills(ckpt, plan, scales))


def linear_fills(
    ckpt: Checkpoint, plan: LinearPlan, scales: dict[str, torch.Tensor]
) -> tuple[Fill, ...]:
    """The weight's rows (each shard's through its code map, where its scheme requantizes it),
    the scales the scheme fuses, and the bias."""
    fused = plan.scheme.scale_fills(plan, plan.shard_scales(scales))
    segments = []
    row = 0
    for shard, code_map in zip(plan.shards, fused.code_maps, strict=True):
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
    fills: list[Fill] = [RowFill(plan.weight, rows, row_bytes, tuple(segments)), *fused.fills]
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

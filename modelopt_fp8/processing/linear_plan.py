"""The plan of one linear layer on one TP rank: where each fused shard's rows come from, and the
tensors and layout vLLM leaves after ``process_weights_after_loading``.

What every layer shares is here: each shard's slice for the rank, its weight's shape, its bias,
the fused widths. What differs by quantization scheme (the weight's dtype, the scales and their
shapes, the processed tensors and layout) is the layer's scheme's (:mod:`modelopt_fp8.schemes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from modelopt_fp8.checkpoint import LinearSpec
from modelopt_fp8.processing.checked_reads import CheckedReads
from modelopt_fp8.processing.tensor_parallel import ShardSlice, shard_slice
from modelopt_fp8.processing.tensor_spec import FLOAT_DTYPES, TensorSpec
from modelopt_fp8.schemes import LinearScheme
from modelopt_fp8.schemes.base import FusedLayer, LaidOut, ShardScales


@dataclass(frozen=True)
class ShardSource:
    """Where one fused shard's data comes from on this rank."""

    weight: str
    slice: ShardSlice
    weight_scale: str | None
    input_scale: str | None
    bias: str | None


@dataclass(frozen=True, kw_only=True)
class LinearPlan(LaidOut):
    """A linear layer laid out by its scheme, with where its shards come from on this rank and
    its bias (every scheme keeps it as stored)."""

    scheme: LinearScheme
    shards: tuple[ShardSource, ...]
    bias: TensorSpec | None

    @property
    def specs(self) -> list[TensorSpec]:
        return [s for s in (self.weight, self.weight_scale, self.input_scale, self.bias) if s]

    def shard_scales(self, scales: Mapping[str, torch.Tensor]) -> list[ShardScales]:
        """Each shard's scales among ``scales`` (the plan's, as read), with its rows."""
        return [
            ShardScales(
                scales[s.weight_scale] if s.weight_scale else None,
                scales[s.input_scale] if s.input_scale else None,
                s.slice.rows,
            )
            for s in self.shards
        ]


def plan_linear(reads: CheckedReads, spec: LinearSpec, tp_size: int, tp_rank: int) -> LinearPlan:
    """Check every shard of ``spec`` in the checkpoint (weight, scales, bias) and lay the fused
    layer out for rank ``tp_rank`` of ``tp_size``."""
    ckpt = reads.ckpt
    scheme = ckpt.quant.scheme_for(spec.prefix)
    shards: list[ShardSource] = []
    for shard in spec.shards:
        sl = shard_slice(spec, shard, ckpt.dims, tp_size, tp_rank)
        w = reads.info(f"{shard.checkpoint_prefix}.weight")
        reads.expect_shape(w, (shard.rows, spec.input_size))
        reads.expect_dtype(w, scheme.weight_dtypes)
        scales = scheme.shard_scales(reads, shard.checkpoint_prefix, shard.rows)
        bias = None
        if spec.has_bias:
            bias = f"{shard.checkpoint_prefix}.bias"
            info = reads.info(bias)
            reads.expect_dtype(info, FLOAT_DTYPES)
            reads.expect_shape(info, (shard.rows,))
        shards.append(ShardSource(w.name, sl, scales.weight_scale, scales.input_scale, bias))
    tensors = ckpt.tensors
    widths = tuple(s.slice.width for s in shards)
    bias_spec = None
    if spec.has_bias:
        bias_dtype = tensors[shards[0].bias or ""].dtype
        bias_spec = TensorSpec.contiguous(f"{spec.prefix}.bias", bias_dtype, (sum(widths),))
    layer = FusedLayer(
        name=spec.prefix,
        widths=widths,
        input_size=shards[0].slice.input_size,
        weight_dtype=tensors[shards[0].weight].dtype,
        quant_algo=ckpt.quant.quant_algo,
        shard_names=tuple(s.checkpoint_prefix for s in spec.shards),
        bias=bias_spec.name if bias_spec else None,
    )
    laid = scheme.lay_out(layer)
    return LinearPlan(**vars(laid), scheme=scheme, shards=tuple(shards), bias=bias_spec)

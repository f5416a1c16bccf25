"""The plan of one linear layer on one TP rank: where each fused shard's rows come from, and the
tensors and layout vLLM's kernel for its scheme expects after ``process_weights_after_loading``.

Quantized layers get the CUTLASS layout (FP8 weight transposed over padded storage, scales
merged per scheme); unquantized ones are held as vLLM holds them, fused and contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from modelopt_fp8.checkpoint import LinearSpec
from modelopt_fp8.processing.checked_reads import FLOAT_DTYPES, CheckedReads
from modelopt_fp8.processing.cutlass import pad_to_alignment, weight_storage_shape, weight_view
from modelopt_fp8.processing.fp8 import FP8_DTYPE
from modelopt_fp8.processing.tensor_parallel import ShardSlice, shard_slice
from modelopt_fp8.processing.tensor_spec import TensorSpec
from protocol.schemas.layout import (
    ActivationQuant,
    Kernel,
    LayerLayout,
    Scheme,
    WeightFormat,
)


@dataclass(frozen=True)
class ShardSource:
    """Where one fused shard's data comes from on this rank."""

    weight: str
    slice: ShardSlice
    weight_scale: str | None
    input_scale: str | None
    bias: str | None


@dataclass(frozen=True)
class LinearPlan:
    layout: LayerLayout
    shards: tuple[ShardSource, ...]
    weight: TensorSpec
    weight_scale: TensorSpec | None
    input_scale: TensorSpec | None
    bias: TensorSpec | None

    @property
    def specs(self) -> list[TensorSpec]:
        return [s for s in (self.weight, self.weight_scale, self.input_scale, self.bias) if s]


def plan_linear(reads: CheckedReads, spec: LinearSpec, tp_size: int, tp_rank: int) -> LinearPlan:
    """Check every shard of ``spec`` in the checkpoint (weight, scales, bias) and lay the fused
    layer out for rank ``tp_rank`` of ``tp_size``."""
    ckpt = reads.ckpt
    scheme = ckpt.quant.scheme_for(spec.prefix)
    quantized = scheme is not Scheme.unquantized
    shards: list[ShardSource] = []
    for shard in spec.shards:
        sl = shard_slice(spec, shard, ckpt.dims, tp_size, tp_rank)
        w = reads.info(f"{shard.checkpoint_prefix}.weight")
        reads.expect_shape(w, (shard.rows, spec.input_size))
        reads.expect_dtype(w, (FP8_DTYPE,) if quantized else FLOAT_DTYPES)
        weight_scale = input_scale = None
        if scheme is Scheme.fp8:
            weight_scale = f"{shard.checkpoint_prefix}.weight_scale"
            input_scale = f"{shard.checkpoint_prefix}.input_scale"
            reads.scale(weight_scale, (), (1,))
            reads.scale(input_scale, (), (1,))
        elif scheme is Scheme.fp8_pc_pt:
            weight_scale = f"{shard.checkpoint_prefix}.weight_scale"
            reads.scale(weight_scale, (shard.rows,), (shard.rows, 1))
        bias = None
        if spec.has_bias:
            bias = f"{shard.checkpoint_prefix}.bias"
            info = reads.info(bias)
            reads.expect_dtype(info, FLOAT_DTYPES)
            reads.expect_shape(info, (shard.rows,))
        shards.append(ShardSource(w.name, sl, weight_scale, input_scale, bias))
    return _lay_out(reads, spec, scheme, shards)


def _lay_out(
    reads: CheckedReads, spec: LinearSpec, scheme: Scheme, shards: list[ShardSource]
) -> LinearPlan:
    tensors = reads.ckpt.tensors
    widths = [s.slice.width for s in shards]
    n, k = sum(widths), shards[0].slice.input_size
    weight_dtype = tensors[shards[0].weight].dtype
    names = {t: f"{spec.prefix}.{t}" for t in ("weight", "weight_scale", "input_scale", "bias")}
    bias_spec = None
    if spec.has_bias:
        bias_dtype = tensors[shards[0].bias or ""].dtype
        bias_spec = TensorSpec.contiguous(names["bias"], bias_dtype, (n,))
    # What the layout says alike of an unquantized and a quantized layer.
    common: dict[str, Any] = {
        "name": spec.prefix,
        "scheme": scheme,
        "format": WeightFormat.default,
        "input_size": k,
        "output_size": n,
        "logical_widths": widths,
        "shard_names": [s.checkpoint_prefix for s in spec.shards],
        "weight": names["weight"],
        "bias": bias_spec.name if bias_spec else None,
    }
    if scheme is Scheme.unquantized:
        weight = TensorSpec.contiguous(names["weight"], weight_dtype, (n, k))
        layout = LayerLayout(
            **common,
            quant_algo=None,
            kernel=Kernel.none,
            processed_weight_dims=None,
            padded_input_size=k,
            padded_output_size=n,
            activation_quant=ActivationQuant.none,
        )
        return LinearPlan(layout, tuple(shards), weight, None, None, bias_spec)

    n_pad, k_pad = weight_storage_shape(n, k)
    shape, stride = weight_view(n, k)
    weight = TensorSpec(names["weight"], FP8_DTYPE, (n_pad, k_pad), shape, stride)
    if scheme is Scheme.fp8:
        weight_scale = TensorSpec.contiguous(names["weight_scale"], torch.float32, ())
        input_scale: TensorSpec | None = TensorSpec.contiguous(
            names["input_scale"], torch.float32, ()
        )
        act = ActivationQuant.static_per_tensor
    else:
        weight_scale = TensorSpec.contiguous(
            names["weight_scale"], torch.float32, (pad_to_alignment(n),)
        )
        input_scale = None
        act = ActivationQuant.dynamic_per_token
    layout = LayerLayout(
        **common,
        quant_algo=reads.ckpt.quant.quant_algo,
        kernel=Kernel.cutlass,
        processed_weight_dims=(0, 1),
        padded_input_size=k_pad,
        padded_output_size=n_pad,
        activation_quant=act,
        weight_scale_shape=list(weight_scale.shape),
        input_scale_shape=list(input_scale.shape) if input_scale else None,
        weight_scale=weight_scale.name,
        input_scale=input_scale.name if input_scale else None,
    )
    return LinearPlan(layout, tuple(shards), weight, weight_scale, input_scale, bias_spec)

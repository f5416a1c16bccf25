"""An FP8 linear forward over processed tensors, with ``cutlass_scaled_mm``'s operand contract.

``a`` is the fp8 activation ``[M, K_pad]`` (row-major), ``b`` the ``[K_pad, N_pad]`` column-major
weight, ``scale_a`` one element (static per-tensor) or ``[M, 1]`` (dynamic per-token),
``scale_b`` one element or ``[N_pad]``. On CUDA the GEMM is ``torch._scaled_mm``; elsewhere an
emulation with the same arithmetic (fp8 operands, float32 accumulation, scales applied to the
float32 product, one rounding to the output dtype). The padded output is sliced back to the
logical width N, as vLLM's CUTLASS kernel does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from modelopt_fp8.processing.fp8 import quantize_per_token, quantize_static
from protocol.schemas.layout import ActivationQuant, LayerLayout


@dataclass(frozen=True)
class Fp8LinearWeights:
    """The processed tensors of one layer, as vLLM keeps them on the module."""

    layout: LayerLayout
    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    input_scale: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def from_tensors(
        cls, layout: LayerLayout, tensors: Mapping[str, torch.Tensor]
    ) -> Fp8LinearWeights:
        def get(name: str | None) -> torch.Tensor | None:
            return tensors[name] if name else None

        return cls(
            layout,
            tensors[layout.weight],
            get(layout.weight_scale),
            get(layout.input_scale),
            get(layout.bias),
        )


def quantize_activation(
    x2d: torch.Tensor, w: Fp8LinearWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 activation and its scale, per the layer's activation-quant mode."""
    if w.layout.activation_quant is ActivationQuant.static_per_tensor:
        assert w.input_scale is not None
        return quantize_static(x2d, w.input_scale), w.input_scale.reshape(1).to(torch.float32)
    if w.layout.activation_quant is ActivationQuant.dynamic_per_token:
        return quantize_per_token(x2d)
    raise ValueError(f"layer {w.layout.name} has no activation quantization")


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``cutlass_scaled_mm(a, b, scale_a, scale_b)`` semantics, without bias."""
    if b.stride(0) != 1 or b.stride(1) % 16 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"operands break the CUTLASS contract: a {tuple(a.shape)}, b {tuple(b.shape)} "
            f"stride {b.stride()}"
        )
    per_row = scale_a.numel() > 1 or scale_b.numel() > 1
    sa = scale_a.reshape(-1, 1) if per_row else scale_a.reshape(())
    sb = scale_b.reshape(1, -1) if per_row else scale_b.reshape(())
    if per_row:
        sa = sa.expand(a.shape[0], 1).contiguous()
        sb = sb.expand(1, b.shape[1]).contiguous()
    if a.is_cuda:
        out: torch.Tensor = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        return out
    acc = a.to(torch.float32) @ b.to(torch.float32)
    return (acc * sa * sb).to(out_dtype)


def fp8_linear(x: torch.Tensor, w: Fp8LinearWeights) -> torch.Tensor:
    """``y = x W^T + b`` for a processed FP8 layer; ``x`` is ``[..., K]`` in bf16/fp16."""
    layout = w.layout
    if layout.activation_quant is ActivationQuant.none:  # an unquantized layer
        return torch.nn.functional.linear(x, w.weight, w.bias)
    x2d = x.reshape(-1, layout.input_size)
    a, scale_a = quantize_activation(x2d, w)
    pad_k = layout.padded_input_size - layout.input_size
    if pad_k:
        a = torch.nn.functional.pad(a.view(torch.uint8), (0, pad_k)).view(a.dtype)
    assert w.weight_scale is not None
    out = scaled_mm(a, w.weight, scale_a, w.weight_scale, x.dtype)
    out = out[:, : layout.output_size]
    if w.bias is not None:
        out = out + w.bias
    return out.reshape(*x.shape[:-1], layout.output_size)

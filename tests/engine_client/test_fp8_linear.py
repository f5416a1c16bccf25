"""The FP8 forward over processed tensors: both schemes, padded and aligned widths, against a
dequantized float reference; and the operand contract it checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_client.fp8_linear import Fp8LinearWeights, fp8_linear, scaled_mm
from modelopt_fp8.checkpoint import Checkpoint
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.fp8 import quantize_per_token, quantize_static
from modelopt_fp8.processing.plan import plan_model
from protocol.schemas.layout import ActivationQuant


def reference(x: torch.Tensor, w: Fp8LinearWeights) -> torch.Tensor:
    """Dequantize the quantized activation and weight, multiply in float64."""
    lay = w.layout
    x2 = x.reshape(-1, lay.input_size)
    if lay.activation_quant is ActivationQuant.static_per_tensor:
        assert w.input_scale is not None
        xq = quantize_static(x2, w.input_scale).double() * w.input_scale.double()
    else:
        q, s = quantize_per_token(x2)
        xq = q.double() * s.double()
    assert w.weight_scale is not None
    wd = w.weight[: lay.input_size, : lay.output_size].double()
    ws = w.weight_scale.double()
    wd = wd * (ws[: lay.output_size] if ws.numel() > 1 else ws)
    out = xq @ wd
    if w.bias is not None:
        out = out + w.bias.double()
    return out


@pytest.mark.parametrize(
    "layer", [0, 1, 2, 3], ids=["qkv-aligned", "o", "gate_up-padded-N", "down-padded-K"]
)
def test_forward_matches_dequantized_reference(tiny_any: Path, layer: int) -> None:
    with Checkpoint.open(tiny_any) as ckpt:
        plan = plan_model(ckpt)
        tensors = process_checkpoint(ckpt, plan)
    w = Fp8LinearWeights.from_tensors(plan.layouts[layer], tensors)
    g = torch.Generator().manual_seed(layer)
    x = (torch.randn(3, 5, w.layout.input_size, generator=g) * 0.5).to(torch.bfloat16)
    y = fp8_linear(x, w)
    assert y.shape == (3, 5, w.layout.output_size) and y.dtype == torch.bfloat16
    ref = reference(x, w).reshape(y.shape)
    rel = (y.double() - ref).norm() / ref.norm()
    assert rel < 1e-2  # only float32 accumulation order and one bf16 rounding differ


def test_padding_is_exercised(tiny_fp8: Path) -> None:
    with Checkpoint.open(tiny_fp8) as ckpt:
        layouts = plan_model(ckpt).layouts
    assert layouts[0].padded_output_size == layouts[0].output_size
    assert layouts[2].padded_output_size > layouts[2].output_size
    assert layouts[3].padded_input_size > layouts[3].input_size


def test_scaled_mm_refuses_a_row_major_weight() -> None:
    a = torch.zeros(2, 32).to(torch.float8_e4m3fn)
    b = torch.zeros(32, 16).to(torch.float8_e4m3fn)  # row-major: stride(0) != 1
    with pytest.raises(ValueError, match="CUTLASS contract"):
        scaled_mm(a, b, torch.ones(1), torch.ones(1), torch.bfloat16)


def test_bias_and_per_token_scales(tiny_pc: Path) -> None:
    with Checkpoint.open(tiny_pc) as ckpt:
        plan = plan_model(ckpt)
        tensors = process_checkpoint(ckpt, plan)
    w = Fp8LinearWeights.from_tensors(plan.layouts[0], tensors)
    bias = torch.linspace(-1, 1, w.layout.output_size).to(torch.bfloat16)
    wb = Fp8LinearWeights(w.layout, w.weight, w.weight_scale, w.input_scale, bias)
    x = torch.randn(4, w.layout.input_size).to(torch.bfloat16)
    x[1] *= 100  # rows with very different ranges get their own scales
    y, yb = fp8_linear(x, w), fp8_linear(x, wb)
    assert torch.allclose(yb.float(), y.float() + bias.float(), rtol=1e-2, atol=2e-2)
    ref = reference(x, w)
    assert ((y.double() - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1e-2

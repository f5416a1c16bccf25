"""Hand-computed cases for the e4m3 arithmetic that must match vLLM's CUDA ops bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from modelopt_fp8.processing.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_SCALING_FACTOR,
    dequantize_to_fp16,
    inverse_scale,
    quantize_per_token,
    quantize_static,
    requantize_to_scale,
)


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def e4m3(*values: float) -> torch.Tensor:
    return torch.tensor(values).to(FP8_DTYPE)


def test_dequantize_rounds_the_scale_to_fp16_like_cuda() -> None:
    # fp16(0.1) = 0.0999755859375; 1.5 * that = 2457/16384 needs 12 bits: ties to even 2456.
    out = dequantize_to_fp16(e4m3(1.5), f32(0.1))
    assert out.dtype == torch.float16
    assert out.item() == 0.14990234375
    # A float32 scale kept unrounded (CPU torch's behaviour) would give 0.1500244140625.
    assert (e4m3(1.5).to(torch.float16) * f32(0.1)).item() == 0.1500244140625


def test_requantize_differs_from_cpu_semantics_where_cuda_rounds() -> None:
    # Found by search: the fp16-rounded scale changes the e4m3 code after requantization.
    w, s, new = e4m3(0.0234375), f32(0.0017102945130318403), f32(0.0031585819087922573)
    assert requantize_to_scale(w, s, new).float().item() == 0.01171875
    cpu_way = quantize_static((w.to(torch.float16) * s), new).float().item()
    assert cpu_way == 0.013671875


def test_inverse_scale_is_correctly_rounded_float32() -> None:
    for s in (0.7, 0.3, 1e-4, 3.0, 0.0031585819087922573):
        inv = inverse_scale(f32(s)).item()
        exact = 1.0 / float(f32(s))
        below = math.nextafter(inv, 0.0)
        above = math.nextafter(inv, math.inf)
        assert abs(inv - exact) <= abs(torch.tensor(below, dtype=torch.float32).item() - exact)
        assert abs(inv - exact) <= abs(torch.tensor(above, dtype=torch.float32).item() - exact)


def test_quantize_static_rounds_to_nearest_even_and_saturates() -> None:
    x = torch.tensor([0.5, 1.0625, 1.1875, 500.0, -1e9, float("inf"), float("-inf")])
    out = quantize_static(x, f32(1.0)).float().tolist()
    # 1.0625 ties between 1.0 and 1.125 -> 1.0 (even); 1.1875 ties -> 1.25 (even mantissa).
    assert out == [0.5, 1.0, 1.25, FP8_MAX, -FP8_MAX, FP8_MAX, -FP8_MAX]


def test_quantize_static_maps_nan_to_max_like_fminf() -> None:
    out = quantize_static(torch.tensor([float("nan")]), f32(2.0))
    assert out.float().item() == FP8_MAX


def test_quantize_static_divides_by_scale_through_its_inverse() -> None:
    # 0.52490234375 * fp32(1/0.7) = 0.749860.. -> 0.75 (e4m3 step 1/16 in [0.5, 1)).
    out = quantize_static(torch.tensor([0.52490234375], dtype=torch.float16), f32(0.7))
    assert out.float().item() == 0.75


def test_quantize_per_token_scales_each_row_by_its_amax() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0, 1.0, -224.0]])
    q, scale = quantize_per_token(x)
    assert scale.shape == (3, 1)
    assert scale[0].item() == pytest.approx(2.0 / 448)
    assert scale[1].item() == pytest.approx(FP8_MIN_SCALING_FACTOR)  # the floor for zero rows
    assert scale[2].item() == 1.0
    assert q[0].float().tolist() == [224.0, -448.0, 112.0]
    assert q[1].float().tolist() == [0.0, 0.0, 0.0]
    assert q[2].float().tolist() == [448.0, 1.0, -224.0]

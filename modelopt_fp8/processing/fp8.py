"""FP8 e4m3 arithmetic exactly as vLLM 0.33's CUDA ops do it, written with portable torch ops so
the CPU gives the same bytes as the GPU.

* ``dequantize_to_fp16`` is ``w8a8_utils.per_tensor_dequantize`` (``weight.to(float16) * scale``).
  On CUDA the float32 scale meets the float16 weight in float16: both operands are float16 and
  their exact product is rounded once to float16. (CPU torch would keep the scale in float32;
  vLLM runs this on the GPU, so the GPU's rounding is the one reproduced.)
* ``quantize_static`` is ``static_scaled_fp8_quant`` (csrc ``scaled_fp8_conversion<true>``):
  ``inv = 1.0f / scale`` correctly rounded, ``x * inv`` in float32, clamped to +-448 with
  ``fminf``/``fmaxf`` (a NaN becomes +448), converted round-to-nearest-even.
* ``quantize_per_token`` is ``dynamic_per_token_scaled_fp8_quant``: per row
  ``scale = max(amax / 448, 1 / (448 * 512))`` and a true division ``x / scale``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
FP8_MIN_SCALING_FACTOR = 1.0 / (FP8_MAX * 512.0)


def dequantize_to_fp16(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight.to(float16) * scale`` with CUDA's operand rounding."""
    w = weight.to(torch.float16).to(torch.float32)
    s = scale.to(torch.float16).to(torch.float32)
    return (w * s).to(torch.float16)


def _saturate_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """``fmaxf(-448, fminf(x, 448))`` then round-to-nearest-even into e4m3."""
    x = torch.where(torch.isnan(x), torch.full_like(x, FP8_MAX), x)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1.0f / scale`` correctly rounded (computed in float64, rounded once to float32, which
    is exact for a float32 quotient)."""
    return (1.0 / scale.to(torch.float64)).to(torch.float32)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor quantization to e4m3 with a 0-dim or 1-element float32 scale."""
    inv = inverse_scale(scale.reshape(()))
    return _saturate_to_fp8(x.to(torch.float32) * inv.to(x.device))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row quantization of a 2-D activation; returns (fp8 [M, K], scale [M, 1])."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALING_FACTOR)
    return _saturate_to_fp8(xf / scale), scale


def requantize_to_scale(
    weight: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor
) -> torch.Tensor:
    """One shard of ``requantize_with_max_scale``: dequantize through float16 with its own
    scale, quantize statically with the fused layer's max scale."""
    return quantize_static(dequantize_to_fp16(weight, scale), new_scale)


_ALL_CODES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
_LUT_CHUNK = 1 << 22  # elements per gather: bounds each temporary to 4 MiB


def requantize_lut(scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    """``requantize_to_scale`` for all 256 e4m3 codes: the map is a function of the code alone,
    so a shard is requantized by one byte gather instead of a dozen float passes."""
    return requantize_to_scale(_ALL_CODES, scale.cpu(), new_scale.cpu()).view(torch.uint8)


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

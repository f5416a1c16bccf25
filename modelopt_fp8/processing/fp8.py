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

import numpy as np
import numpy.typing as npt
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


def requantize_lut(scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    """``requantize_to_scale`` for all 256 e4m3 codes: the map is a function of the code alone,
    so a shard is requantized by one byte gather instead of a dozen float passes."""
    return requantize_to_scale(_ALL_CODES, scale.cpu(), new_scale.cpu()).view(torch.uint8)


_PAIR = np.dtype("<u2")  # two consecutive codes, the first in the low byte


class CodeMap:
    """A map of e4m3 codes (``lut[code]``), applied to bytes with NumPy.

    The gather runs on pairs of codes through a 65536-entry table (128 KiB, cache resident):
    half the lookups of a byte table. It goes in slices small enough that NumPy's index
    temporary stays in cache, and NumPy releases the GIL while it gathers.
    """

    SLICE = 1 << 17  # pairs per gather

    def __init__(self, lut: torch.Tensor) -> None:
        table = lut.to(torch.uint8).numpy().copy()
        if table.shape != (256,):
            raise ValueError("a code map has 256 entries")
        self.table = table
        # The NaN codes (0x7f, 0xff: refused before any map runs) aside, does it change nothing?
        finite = np.ones(256, dtype=bool)
        finite[[0x7F, 0xFF]] = False
        self.identity = bool((table == np.arange(256, dtype=np.uint8))[finite].all())
        wide = table.astype(_PAIR)
        # pairs[hi * 256 + lo] = table[lo] | table[hi] << 8: the uint16 of two little-endian codes
        self.pairs = ((wide[:, None] << 8) | wide[None, :]).reshape(-1)

    def apply(self, src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8]) -> None:
        """``dst[...] = table[src]`` for same-shaped byte arrays (``dst`` may be strided)."""
        if src.shape != dst.shape:
            raise ValueError(f"shapes differ: {src.shape} and {dst.shape}")
        if not (src.flags.c_contiguous and dst.flags.c_contiguous and src.size % 2 == 0):
            dst[...] = self.table[src]
            return
        codes = src.reshape(-1).view(_PAIR)
        out = dst.reshape(-1).view(_PAIR)
        for i in range(0, codes.size, self.SLICE):
            np.take(self.pairs, codes[i : i + self.SLICE], out=out[i : i + self.SLICE], mode="clip")


def requantize_map(scale: torch.Tensor, new_scale: torch.Tensor) -> CodeMap:
    """The code map that requantizes a shard at ``scale`` to the fused ``new_scale``."""
    return CodeMap(requantize_lut(scale, new_scale))

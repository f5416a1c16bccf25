"""Refusing corrupt tensor data: a NaN or infinite weight is never valid in a checkpoint.

ModelOpt never writes an e4m3 NaN code (0x7f, 0xff: its quantizer clamps to +-448), and
embeddings, norms and biases are finite, so such values mean bit rot or a damaged download.
Headers and scales are checked before anything is allocated; this catches what only reading the
data can, while a load is under way, and the load then fails as a whole. Both checks are single
reductions (a max over masked e4m3 bits, a min/max over floats, where NaN propagates), so they
cost a fraction of the copy they follow.
"""

from __future__ import annotations

import math

import torch

from modelopt_fp8.processing.fp8 import FP8_DTYPE
from protocol.errors import CorruptFileError

_E4M3_NAN_BITS = 0x7F
_CHUNK = 1 << 22  # elements per reduction: keeps the masked temporary in cache


def _has_e4m3_nan(tensor: torch.Tensor) -> bool:
    codes = tensor.reshape(-1).view(torch.uint8)
    for start in range(0, codes.numel(), _CHUNK):
        if int(codes[start : start + _CHUNK].bitwise_and(_E4M3_NAN_BITS).max()) == 0x7F:
            return True
    return False


def _has_non_finite(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0:
        return False
    low, high = torch.aminmax(tensor.reshape(-1))
    return not (math.isfinite(float(low)) and math.isfinite(float(high)))


def require_finite(tensor: torch.Tensor, name: str, file: str) -> None:
    if tensor.dtype == FP8_DTYPE:
        bad = tensor.numel() > 0 and _has_e4m3_nan(tensor)
    elif tensor.is_floating_point():
        bad = _has_non_finite(tensor)
    else:
        return
    if bad:
        raise CorruptFileError("tensor data holds NaN or infinite values", file=file, tensor=name)

"""Refusing corrupt tensor data: a NaN or infinite weight is never valid in a checkpoint.

ModelOpt never writes an e4m3 NaN code (0x7f, 0xff: its quantizer clamps to +-448), and
embeddings, norms and biases are finite, so such values mean bit rot or a damaged download.
Headers and scales are checked before anything is allocated; this catches what only reading the
data can, while a load is under way, and the load then fails as a whole.
"""

from __future__ import annotations

import torch

from service.errors import CorruptFileError
from service.processing.fp8 import FP8_DTYPE

_E4M3_NAN_BITS = 0x7F


def require_finite(tensor: torch.Tensor, name: str, file: str) -> None:
    if tensor.dtype == FP8_DTYPE:
        bad = bool(((tensor.view(torch.uint8) & _E4M3_NAN_BITS) == _E4M3_NAN_BITS).any())
    elif tensor.is_floating_point():
        bad = not bool(torch.isfinite(tensor).all())
    else:
        return
    if bad:
        raise CorruptFileError("tensor data holds NaN or infinite values", file=file, tensor=name)

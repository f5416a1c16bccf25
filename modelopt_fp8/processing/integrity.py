"""Refusing corrupt tensor data: a NaN or infinite weight is never valid in a checkpoint.

ModelOpt never writes an e4m3 NaN code (0x7f, 0xff: its quantizer clamps to +-448), and
embeddings, norms and biases are finite, so such values mean bit rot or a damaged download.
Headers and scales are checked before anything is allocated; this catches what only reading the
data can, while a load is under way, and the load then fails as a whole.

The test works on the bits, with two integer maxima and no temporary: a float is NaN or infinite
when its bits without the sign are at least the all-ones exponent ``E`` (for e4m3, whose only
non-finite codes are the NaNs, ``E = 0x7f``). Read as signed integers the positive values keep
their order, so ``max >= E`` finds the positive ones; read as unsigned the negative ones sit above
``sign | E``. Both maxima are vectorized NumPy reductions that release the GIL, so the check runs
in the loading threads on data they have just read, while it is still in cache.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from modelopt_fp8.processing.fp8 import FP8_DTYPE

# dtype -> (signed view, unsigned view, all-ones exponent bits without the sign)
_NON_FINITE_FROM: dict[
    torch.dtype, tuple[type[np.signedinteger], type[np.unsignedinteger], int]
] = {
    FP8_DTYPE: (np.int8, np.uint8, 0x7F),
    torch.float8_e5m2: (np.int8, np.uint8, 0x7C),
    torch.float16: (np.int16, np.uint16, 0x7C00),
    torch.bfloat16: (np.int16, np.uint16, 0x7F80),
    torch.float32: (np.int32, np.uint32, 0x7F800000),
    torch.float64: (np.int64, np.uint64, 0x7FF0000000000000),
}


def has_non_finite(data: npt.NDArray[np.uint8], dtype: torch.dtype) -> bool:
    """Whether the contiguous bytes ``data``, read as ``dtype``, hold a NaN or an infinity."""
    found = _NON_FINITE_FROM.get(dtype)
    if found is None or data.size == 0:
        return False
    signed, unsigned, exponent = found
    flat = data.reshape(-1)
    if int(flat.view(signed).max()) >= exponent:
        return True
    sign = 1 << (8 * np.dtype(unsigned).itemsize - 1)
    return int(flat.view(unsigned).max()) >= sign | exponent


# The same test on a device, with torch: an integer view of the data's width (uint8 for one byte,
# whose & clears the sign), the bits without the sign, and the same all-ones exponents.
_TORCH_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NON_FINITE_BITS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    dtype: (_TORCH_VIEW[dtype.itemsize], (1 << (8 * dtype.itemsize - 1)) - 1, exponent)
    for dtype, (_, _, exponent) in _NON_FINITE_FROM.items()
}


def any_non_finite(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Whether the bytes ``raw`` (uint8 ``[rows, width]``, rows may be strided), read as
    ``dtype``, hold a NaN or an infinity: a 0-dim bool tensor on ``raw``'s device, computed
    without waiting for it (None for data that is not checked). The same bit test as
    :func:`has_non_finite`, as device operations."""
    found = _NON_FINITE_BITS.get(dtype)
    if found is None or raw.numel() == 0:
        return None
    view, magnitude, exponent = found
    bits = raw.view(view)
    return (bits & magnitude).max() >= exponent

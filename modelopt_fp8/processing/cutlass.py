"""The CUTLASS kernel's layout rules (vLLM 0.33 ``CutlassFP8ScaledMMLinearKernel``).

``process_weights_after_loading`` keeps ``logical_output_size = N`` and pads the ``[K, N]``
column-major weight so both K and N are multiples of 16, with zeros; a per-channel weight scale is
padded with 1.0 (a per-tensor one is left alone). At run time the activation is padded to the same
K and the output sliced back to N.
"""

from __future__ import annotations

CUTLASS_ALIGNMENT = 16


def pad_to_alignment(size: int, alignment: int = CUTLASS_ALIGNMENT) -> int:
    """``size`` rounded up to a multiple of ``alignment``."""
    return size + (-size) % alignment


def weight_storage_shape(n: int, k: int) -> tuple[int, int]:
    """The row-major ``[N_pad, K_pad]`` buffer behind the ``[K_pad, N_pad]`` weight view."""
    return pad_to_alignment(n), pad_to_alignment(k)


def weight_view(n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shape and stride of the column-major ``[K_pad, N_pad]`` weight CUTLASS consumes
    (``b.stride(0) == 1`` and ``b.stride(1) == K_pad``, a multiple of 16)."""
    n_pad, k_pad = weight_storage_shape(n, k)
    return (k_pad, n_pad), (1, k_pad)

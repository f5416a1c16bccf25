"""A tensor the cache holds: the contiguous storage it occupies in an arena and the view it is
exposed as, which may be strided (CUTLASS wants the FP8 weight transposed over padded storage).

The plan, the arena and the row fills all size and address tensors through this one type, so
what is allocated and what is exposed cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The dtypes of a tensor held as stored: unquantized weights, biases, norms, embeddings.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be held: its contiguous storage and the (possibly strided) view exposed."""

    name: str
    dtype: torch.dtype
    storage_shape: tuple[int, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def contiguous(cls, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
        return cls(name, dtype, shape, shape, contiguous_stride(shape))

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.storage_shape:
            n *= d
        return n

    def view(self, storage: torch.Tensor) -> torch.Tensor:
        """The exposed tensor over a contiguous ``storage`` of :attr:`storage_shape`."""
        return storage.as_strided(self.shape, self.stride)

    def storage_of(self, view: torch.Tensor) -> torch.Tensor:
        """The contiguous storage behind a tensor made by :meth:`view` (the inverse)."""
        return view.as_strided(self.storage_shape, contiguous_stride(self.storage_shape))

"""Packing tensors into one arena: every storage starts on a 256-byte boundary."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from modelopt_fp8.processing.cutlass import pad_to_alignment
from modelopt_fp8.processing.tensor_spec import TensorSpec

ALIGNMENT = 256


@dataclass(frozen=True)
class ArenaLayout:
    offsets: dict[str, int]
    nbytes: int


def pack(specs: Iterable[TensorSpec], alignment: int = ALIGNMENT) -> ArenaLayout:
    offsets: dict[str, int] = {}
    cursor = 0
    for spec in specs:
        if spec.name in offsets:
            raise ValueError(f"tensor {spec.name} planned twice")
        cursor = pad_to_alignment(cursor, alignment)
        offsets[spec.name] = cursor
        cursor += spec.nbytes
    return ArenaLayout(offsets, max(cursor, alignment))

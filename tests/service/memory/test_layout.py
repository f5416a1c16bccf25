"""Packing: every storage 256-byte aligned, no overlaps, sizes exact."""

from __future__ import annotations

import itertools

import pytest
import torch

from modelopt_fp8.processing.tensor_spec import TensorSpec
from protocol.checksum import storage_checksum
from service.memory.layout import ALIGNMENT, pack


def test_pack_aligns_and_never_overlaps() -> None:
    specs = [
        TensorSpec.contiguous("a", torch.float32, ()),
        TensorSpec("w", torch.float8_e4m3fn, (176, 64), (64, 176), (1, 64)),
        TensorSpec.contiguous("s", torch.float32, (176,)),
        TensorSpec.contiguous("e", torch.bfloat16, (3, 5)),
    ]
    layout = pack(specs)
    assert layout.offsets == {"a": 0, "w": 256, "s": 256 + 11264, "e": 256 + 11264 + 768}
    ends = sorted((layout.offsets[s.name], layout.offsets[s.name] + s.nbytes) for s in specs)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))
    assert all(o % ALIGNMENT == 0 for o in layout.offsets.values())
    assert layout.nbytes == ends[-1][1]
    with pytest.raises(ValueError, match="twice"):
        pack([specs[0], specs[0]])


def test_checksum_is_over_bytes() -> None:
    a = torch.arange(16, dtype=torch.float32)
    assert storage_checksum(a) == storage_checksum(a.clone())
    b = a.clone()
    b[3] = 0.5
    assert storage_checksum(a) != storage_checksum(b)
    assert len(storage_checksum(a)) == 16
    with pytest.raises(ValueError, match="contiguous"):
        storage_checksum(a.view(4, 4).t())

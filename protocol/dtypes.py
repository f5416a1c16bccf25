"""The wire dtype names and the torch dtypes they stand for (a closed list, both ways)."""

from __future__ import annotations

import torch

from protocol.schemas.layout import WireDType

TORCH_DTYPES: dict[WireDType, torch.dtype] = {
    WireDType.float8_e4m3fn: torch.float8_e4m3fn,
    WireDType.float32: torch.float32,
    WireDType.float16: torch.float16,
    WireDType.bfloat16: torch.bfloat16,
}
WIRE_DTYPES: dict[torch.dtype, WireDType] = {v: k for k, v in TORCH_DTYPES.items()}


def to_wire(dtype: torch.dtype) -> WireDType:
    try:
        return WIRE_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel in a manifest") from None


def to_torch(dtype: WireDType | str) -> torch.dtype:
    return TORCH_DTYPES[WireDType(dtype)]

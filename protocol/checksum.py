"""Per-tensor checksums: xxh3-64 of a tensor's storage bytes.

xxHash (the ``xxhash`` package) hashes at memory speed, which keeps the one pass at load time
cheap; engines can recompute it over the mapped bytes to verify them.
"""

from __future__ import annotations

import torch
import xxhash


def storage_checksum(storage: torch.Tensor) -> str:
    """Hex xxh3-64 of a contiguous tensor's bytes (copied to the host first if on a GPU)."""
    if not storage.is_contiguous():
        raise ValueError("checksums are taken over contiguous storage")
    host = storage.detach().cpu() if storage.device.type != "cpu" else storage.detach()
    data = host.reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(data.data)

"""On a GPU: a storage's checksum streamed through the pinned pair equals the one-shot xxh3-64
of its bytes on the host, for storages of no bytes, less than a chunk, and many chunks that do
not end on a chunk's edge, and for the host copies a pinned buffer is reused between."""

from __future__ import annotations

import pytest
import torch
import xxhash

from protocol.checksum import CHUNK_BYTES, storage_checksum

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("nbytes", "dtype"),
    [(0, torch.uint8), (4096, torch.bfloat16), (3 * CHUNK_BYTES + 1000, torch.uint8)],
)
def test_a_gpu_storage_s_checksum_is_its_bytes_xxh3(nbytes: int, dtype: torch.dtype) -> None:
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    on_gpu = host.to("cuda").view(dtype)
    assert storage_checksum(on_gpu) == xxhash.xxh3_64_hexdigest(host.numpy().data)


def test_storages_hashed_one_after_another_do_not_mix() -> None:
    """The thread's pinned buffers carry each storage's chunks in turn: two storages whose
    first chunks differ but whose tails agree still get their own checksums."""
    first = torch.randint(0, 256, (2 * CHUNK_BYTES + 7,), dtype=torch.uint8)
    second = first.clone()
    second[0] ^= 1
    sums = [storage_checksum(t.to("cuda")) for t in (first, second, first)]
    assert sums[0] == sums[2] == xxhash.xxh3_64_hexdigest(first.numpy().data)
    assert sums[1] == xxhash.xxh3_64_hexdigest(second.numpy().data) != sums[0]

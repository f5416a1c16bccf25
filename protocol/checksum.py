"""Per-tensor checksums: xxh3-64 of a tensor's storage bytes.

xxHash (the ``xxhash`` package) hashes at memory speed, which keeps the one pass at load time
cheap; engines can recompute it over the mapped bytes to verify them. A storage on a GPU comes
to the host in chunks through two pinned buffers of the calling thread (one chunk on its way
while the one before is hashed): copying gigabytes into fresh pageable memory ran at about
1 GB/s, a tenth of what the link and the hash do.
"""

from __future__ import annotations

import threading

import torch
import xxhash

CHUNK_BYTES = 16 << 20  # one pinned buffer; each thread that hashes GPU storage keeps two
# The slowest rate at which a host is taken to check storage bytes (a copy to the host and
# the hash), for deadlines of requests whose work is a checksum of every byte they name.
SLOWEST_CHECK_BYTES_PER_S = 256 << 20

_local = threading.local()


def storage_checksum(storage: torch.Tensor) -> str:
    """Hex xxh3-64 of a contiguous tensor's bytes (those on a GPU copied to the host first)."""
    if not storage.is_contiguous():
        raise ValueError("checksums are taken over contiguous storage")
    flat = storage.detach().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return xxhash.xxh3_64_hexdigest(flat.numpy().data)
    return _device_checksum(flat)


def checking_s(nbytes: int) -> float:
    """The longest checking ``nbytes`` of storage may take (a bound for deadlines)."""
    return nbytes / SLOWEST_CHECK_BYTES_PER_S


def _pinned_pair() -> list[torch.Tensor]:
    pair: list[torch.Tensor] | None = getattr(_local, "pinned", None)
    if pair is None:
        pair = _local.pinned = [
            torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
        ]
    return pair


def _device_checksum(flat: torch.Tensor) -> str:
    """The xxh3-64 of a GPU storage, streamed chunk by chunk through the thread's pinned pair
    (the same digest as one pass over the whole: xxh3's streaming form)."""
    digest = xxhash.xxh3_64()
    buffers = _pinned_pair()
    stream = torch.cuda.current_stream(flat.device)
    pending: tuple[torch.Tensor, torch.cuda.Event] | None = None
    for turn, start in enumerate(range(0, flat.numel(), CHUNK_BYTES)):
        chunk = flat[start : start + CHUNK_BYTES]
        buffer = buffers[turn % 2][: chunk.numel()]  # hashed in the turn before last: free
        buffer.copy_(chunk, non_blocking=True)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(stream)
        if pending is not None:
            _hash(digest, pending)
        pending = (buffer, copied)
    if pending is not None:
        _hash(digest, pending)
    return digest.hexdigest()


def _hash(digest: xxhash.xxh3_64, pending: tuple[torch.Tensor, torch.cuda.Event]) -> None:
    buffer, copied = pending
    copied.synchronize()
    digest.update(buffer.numpy().data)

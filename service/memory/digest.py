"""A digest of a whole arena computed where it lives, so a daemon that adopts a GPU arena checks
it in milliseconds instead of copying gigabytes to the host for the manifest's xxh3.

The arena is read as 64-bit words in blocks of 64 MiB (bounded scratch); each word is mixed
with its position (XOR with the position times an odd constant, then multiplied by another,
wrapping), and each block contributes two sums of its words mixed two ways. A changed byte
changes its word's mixed value and so the sums; words swapped between places change them too.
The blocks' sums, copied to the host (a few hundred integers), are hashed with xxh3-128. Like
xxh3 this guards against accidents and stray writes, not against someone who can write the
arena on purpose. The same arithmetic on the same device gives the same digest; it is only ever
compared on the device that computed it.
"""

from __future__ import annotations

import torch
import xxhash

from service.memory.arena import Arena, VmmArena

BLOCK_BYTES = 64 << 20
_WORDS = BLOCK_BYTES // 8
# Odd 64-bit constants (as signed int64), so multiplication by them is a bijection mod 2^64.
_POSITION = -7046029254386353131  # 0x9E3779B97F4A7C15
_LANE_A = -4658895280553007687  # 0xBF58476D1CE4E5B9
_LANE_B = -7723592293110705685  # 0x94D049BB133111EB


def arena_digest(base: torch.Tensor) -> str:
    """The digest of the 1-D uint8 tensor ``base`` (an arena), computed on its device."""
    if base.dtype != torch.uint8 or base.dim() != 1:
        raise ValueError("an arena is a 1-D uint8 tensor")
    if base.is_cuda:  # the writes of other streams (the load's) are done before it reads
        torch.cuda.synchronize(base.device)
    nbytes = base.numel()
    whole = nbytes // 8 * 8
    sums: list[torch.Tensor] = []
    with torch.no_grad():
        positions = torch.arange(
            min(_WORDS, max(1, whole // 8)), dtype=torch.int64, device=base.device
        )
        for start in range(0, whole, BLOCK_BYTES):
            words = base[start : min(whole, start + BLOCK_BYTES)].view(torch.int64)
            place = positions[: words.numel()] + start // 8
            place.mul_(_POSITION)
            mixed = torch.bitwise_xor(words, place)
            lane_a = mixed.mul(_LANE_A).sum()
            mixed.add_(place).mul_(_LANE_B)
            lane_b = torch.bitwise_xor(mixed, words).sum()
            sums += [lane_a, lane_b]
        tail = base[whole:]
        if tail.numel():
            padded = torch.zeros(8, dtype=torch.uint8, device=base.device)
            padded[: tail.numel()] = tail
            sums.append(padded.view(torch.int64)[0])
        host = torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.int64)
    digest = xxhash.xxh3_128()
    digest.update(nbytes.to_bytes(8, "little"))
    digest.update(host.numpy().tobytes())
    return f"arena64:{digest.hexdigest()}"


def kept_digest(arena: Arena) -> str | None:
    """The digest a new daemon checks when it adopts ``arena`` from the keeper, taken once its
    bytes are written (a load's, a donation's commit): GPU arenas only; a shared-memory arena is
    checked by its tensors' checksums."""
    return arena_digest(arena.base) if isinstance(arena, VmmArena) else None

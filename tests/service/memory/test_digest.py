"""The arena digest (the same torch arithmetic on a GPU): equal bytes, equal digests; a changed
byte, or two words swapped, change it; blocks and a tail that is not a whole word count."""

from __future__ import annotations

import pytest
import torch

from service.memory import digest
from service.memory.digest import arena_digest


@pytest.mark.parametrize("nbytes", [1, 7, 8, 4096 + 3, 3 * 4096])
def test_equal_bytes_equal_digests_and_any_change_shows(
    monkeypatch: pytest.MonkeyPatch, nbytes: int
) -> None:
    monkeypatch.setattr(digest, "BLOCK_BYTES", 4096)  # several blocks, a short last one
    monkeypatch.setattr(digest, "_WORDS", 512)
    gen = torch.Generator().manual_seed(nbytes)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    first = arena_digest(base)
    assert first == arena_digest(base.clone()) and first.startswith("arena64:")
    for where in {0, nbytes // 2, nbytes - 1}:
        changed = base.clone()
        changed[where] ^= 1
        assert arena_digest(changed) != first, where
    if nbytes >= 16:
        swapped = base.clone()
        swapped[:8], swapped[8:16] = base[8:16].clone(), base[:8].clone()
        if not torch.equal(swapped, base):
            assert arena_digest(swapped) != first
    assert arena_digest(torch.zeros(nbytes, dtype=torch.uint8)) != arena_digest(
        torch.zeros(nbytes + 1, dtype=torch.uint8)
    )

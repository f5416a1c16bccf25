"""Shared-memory arenas: read-only mappings, unlink-while-mapped, stale-file cleanup by lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protocol.shm import map_read_only
from service.memory.shm import FILE_PREFIX, ShmFile, remove_stale_files


def test_read_only_mapping_sees_writes_and_refuses_its_own(tmp_path: Path) -> None:
    arena = ShmFile(tmp_path, "b00t", "m-r0", 4096)
    arena.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    view = map_read_only(arena.path, 4096)
    assert view[:4].tolist() == [1, 2, 3, 4]
    arena.tensor[0] = 9  # the daemon's writes are visible: same pages, no copy
    assert view[0].item() == 9
    with pytest.raises(ValueError, match="manifest says"):
        map_read_only(arena.path, 8192)
    del view
    arena.close()
    assert not arena.path.exists()


def test_unlinking_keeps_an_engines_mapping(tmp_path: Path) -> None:
    arena = ShmFile(tmp_path, "b00t", "m-r0", 4096)
    arena.tensor.fill_(7)
    view = map_read_only(arena.path, 4096)
    arena.close()  # the daemon unloads
    assert not arena.path.exists()
    assert int(view.sum()) == 7 * 4096  # memory is not freed under the engine
    slice_ = view[100:200]
    del view  # the last reference to the whole mapping goes; a slice of it keeps the pages
    assert int(slice_.sum()) == 7 * 100


def test_a_full_tmpfs_is_refused_up_front(tmp_path: Path) -> None:
    from protocol.errors import InsufficientMemoryError

    with pytest.raises(InsufficientMemoryError):
        ShmFile(Path("/dev/shm"), "b00t", "huge", 1 << 50)  # more than any machine has
    assert not any(p.name.startswith(f"{FILE_PREFIX}b00t-huge") for p in Path("/dev/shm").iterdir())


def test_stale_files_of_dead_daemons_are_removed(tmp_path: Path) -> None:
    live = ShmFile(tmp_path, "aaaa", "live", 4096)
    # A daemon that dies leaves its file behind; its lock dies with it.
    code = (
        "import sys, pathlib; from service.memory.shm import ShmFile; "
        "f = ShmFile(pathlib.Path(sys.argv[1]), 'dead', 'gone', 4096); print(f.path)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    dead = Path(out.stdout.strip())
    assert dead.exists() and dead.name.startswith(FILE_PREFIX)
    unrelated = tmp_path / "something-else"
    unrelated.write_bytes(b"x")
    assert remove_stale_files(tmp_path) == [dead]
    assert live.path.exists() and unrelated.exists() and not dead.exists()
    live.close()

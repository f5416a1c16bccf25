"""Shared-memory arenas: a private directory, read-only mappings, unlink-while-mapped, and a
stale-file cleanup that only removes unlocked regular files of this user."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from harness.python_child import run_python
from protocol.errors import InsufficientMemoryError, ShmDirError
from protocol.shm import map_path
from service.memory.shm import (
    FILE_PREFIX,
    ArenaDir,
    ShmFile,
    arena_dir_path,
    remove_stale_files,
)


@pytest.fixture
def arenas(tmp_path: Path):
    directory = ArenaDir.prepare(tmp_path)
    yield directory
    directory.close()


def test_read_only_mapping_sees_writes_and_refuses_its_own(arenas: ArenaDir) -> None:
    arena = ShmFile(arenas, "b00t", "m-r0", 4096)
    arena.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    view = map_path(arena.path, 4096)
    assert view[:4].tolist() == [1, 2, 3, 4]
    arena.tensor[0] = 9  # the daemon's writes are visible: same pages, no copy
    assert view[0].item() == 9
    with pytest.raises(ValueError, match="manifest says"):
        map_path(arena.path, 8192)
    del view
    arena.close()
    assert not arena.path.exists()


def test_unlinking_keeps_an_engines_mapping(arenas: ArenaDir) -> None:
    arena = ShmFile(arenas, "b00t", "m-r0", 4096)
    arena.tensor.fill_(7)
    view = map_path(arena.path, 4096)
    arena.close()  # the daemon unloads
    assert not arena.path.exists()
    assert int(view.sum()) == 7 * 4096  # memory is not freed under the engine
    slice_ = view[100:200]
    del view  # the last reference to the whole mapping goes; a slice of it keeps the pages
    assert int(slice_.sum()) == 7 * 100


def test_a_full_tmpfs_is_refused_up_front() -> None:
    directory = ArenaDir.prepare(Path("/dev/shm"))
    try:
        with pytest.raises(InsufficientMemoryError):
            ShmFile(directory, "b00t", "huge", 1 << 50)  # more than any machine has
        assert not any("b00t-huge" in p.name for p in directory.path.iterdir())
    finally:
        directory.close()


def test_directory_and_files_are_private(tmp_path: Path, arenas: ArenaDir) -> None:
    old = os.umask(0)  # whatever the umask, the modes are exact
    try:
        arena = ShmFile(arenas, "b00t", "m-r0", 4096)
    finally:
        os.umask(old)
    assert arenas.path == arena_dir_path(tmp_path)
    assert stat.S_IMODE(arenas.path.stat().st_mode) == 0o700
    assert stat.S_IMODE(arena.path.stat().st_mode) == 0o600
    assert arena.path.stat().st_uid == os.geteuid()
    arena.close()


def test_a_group_opens_them_to_0640(tmp_path: Path) -> None:
    group = __import__("grp").getgrgid(os.getegid()).gr_name
    directory = ArenaDir.prepare(tmp_path, group)
    arena = ShmFile(directory, "b00t", "m-r0", 4096)
    assert stat.S_IMODE(directory.path.stat().st_mode) == 0o750
    assert stat.S_IMODE(arena.path.stat().st_mode) == 0o640
    assert arena.path.stat().st_gid == os.getegid()
    arena.close()
    directory.close()
    with pytest.raises(ShmDirError, match="no group"):
        ArenaDir.prepare(tmp_path, "no-such-group-here")


def test_a_planted_directory_or_link_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    arena_dir_path(tmp_path).symlink_to(target)
    with pytest.raises(ShmDirError):
        ArenaDir.prepare(tmp_path)
    arena_dir_path(tmp_path).unlink()
    arena_dir_path(tmp_path).mkdir()
    os.chown(arena_dir_path(tmp_path), 65534, 65534)  # someone else's (we run as root here)
    with pytest.raises(ShmDirError, match="belongs to uid 65534"):
        ArenaDir.prepare(tmp_path)


def test_stale_files_of_dead_daemons_are_removed(tmp_path: Path, arenas: ArenaDir) -> None:
    live = ShmFile(arenas, "aaaa", "live", 4096)
    # A daemon that dies leaves its file behind; its lock dies with it.
    code = (
        "import sys, pathlib; from service.memory.shm import ArenaDir, ShmFile; "
        "f = ShmFile(ArenaDir.prepare(pathlib.Path(sys.argv[1])), 'dead', 'gone', 4096); "
        "print(f.path)"
    )
    out = run_python(code, str(tmp_path))
    dead = Path(out.stdout.strip())
    assert dead.exists() and dead.name.startswith(FILE_PREFIX)
    half = arenas.path / f".{FILE_PREFIX}dead-half-0000"  # killed between create and rename
    half.write_bytes(b"x" * 4096)
    unrelated = arenas.path / "something-else"
    unrelated.write_bytes(b"x")
    fifo = arenas.path / f"{FILE_PREFIX}fifo"
    os.mkfifo(fifo)  # opening it for reading would block a careless cleanup for good
    link = arenas.path / f"{FILE_PREFIX}link"
    link.symlink_to(unrelated)
    foreign = arenas.path / f"{FILE_PREFIX}foreign"
    foreign.write_bytes(b"x")
    os.chown(foreign, 65534, 65534)
    assert sorted(arenas.remove_stale()) == sorted([dead, half])
    assert live.path.exists() and unrelated.exists() and not dead.exists()
    assert fifo.exists() and link.is_symlink() and foreign.exists()
    live.close()


def test_legacy_files_in_the_root_are_removed(tmp_path: Path) -> None:
    old = tmp_path / f"{FILE_PREFIX}old-daemon-r0-1234"
    old.write_bytes(b"x")
    assert remove_stale_files(tmp_path) == [old]

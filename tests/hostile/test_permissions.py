"""Auth and permissions: tokens strong enough to expose, 401s that say how to authenticate,
arenas no other user can read, and a shared-memory directory nobody can plant things in."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from harness.daemon_process import start_daemon
from harness.hostile.probe import HealthProbe
from harness.hostile.users import NOBODY, needs_root, run_as
from harness.python_child import run_python
from service.memory.shm import FILE_PREFIX, arena_dir_path
from tests.hostile.conftest import Hostile
from weight_cache_cli import cli


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A shared-memory root every user can reach (as /dev/shm is), so a permission refusal
    comes from the daemon's modes, not from a private test directory above them."""
    root = Path(tempfile.mkdtemp(prefix="wc-hostile-", dir="/dev/shm"))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    "token", ["x", "               ", "short token 123", "a\tb\tc\td\te\tf\tg\th"]
)
def test_a_weak_token_cannot_expose_the_daemon(token: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["serve", "--host", "0.0.0.0", "--shm-dir", str(tmp_path), "--device", "cpu"],
        env={"WEIGHT_CACHE_TOKEN": token, "WEIGHT_CACHE_CACHE_DIR": str(tmp_path)},
    )
    assert result.exit_code == 2  # refused before anything binds
    assert "token" in result.output


@needs_root
def test_a_token_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    """A 0600 token file of another user (who knows the token, and may change it) was
    accepted: the daemon refuses to start on it; the daemon's own user's or root's is taken."""
    from service.settings import DaemonSettings

    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    token.chmod(0o600)
    os.chown(token, NOBODY, NOBODY)
    result = CliRunner().invoke(
        cli,
        ["serve", "--token-file", str(token), "--shm-dir", str(tmp_path), "--device", "cpu"],
        env={"WEIGHT_CACHE_CACHE_DIR": str(tmp_path)},
    )
    assert result.exit_code == 2  # refused before anything binds
    assert f"belongs to uid {NOBODY}" in result.output
    os.chown(token, 0, 0)
    assert DaemonSettings(token_file=token).token is not None


def test_401_says_how_to_authenticate(tmp_path: Path, tiny_fp8: Path) -> None:
    token = "s3cret-token-0123456789"
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", env={"WEIGHT_CACHE_TOKEN": token}
    )
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            r = httpx.get(f"{daemon.url}/v1/inventory", headers=headers)
            assert r.status_code == 401 and r.json()["code"] == "unauthorized"
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        r = httpx.get(f"{daemon.url}/v1/inventory", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
    finally:
        daemon.stop()


def test_arenas_are_private_to_the_daemons_user(hostile: Hostile) -> None:
    directory = hostile.daemon.shm_dir
    (arena,) = [p for p in directory.iterdir() if p.name.startswith(FILE_PREFIX)]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(arena.stat().st_mode) == 0o600
    assert directory.stat().st_uid == arena.stat().st_uid == os.geteuid()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_list_or_read_arenas(
    tmp_path: Path, tiny_fp8: Path, open_root: Path
) -> None:
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", shm_dir=open_root)
    try:
        (arena,) = [p for p in daemon.shm_dir.iterdir() if p.name.startswith(FILE_PREFIX)]
        arena_copy = open_root / "readable-copy"  # the control: the same bytes, world-readable
        arena_copy.write_bytes(arena.read_bytes()[:16])
        arena_copy.chmod(0o644)
    finally:
        daemon.stop()
    code = (
        "import os, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "for op in (lambda: os.listdir(sys.argv[1]), lambda: open(sys.argv[2], 'rb').read(1)):\n"
        "    try:\n"
        "        op(); print('allowed')\n"
        "    except PermissionError:\n"
        "        print('denied')\n"
    )

    def as_nobody(directory: Path, file: Path) -> list[str]:
        return run_python(code, str(directory), str(file), timeout=30).stdout.split()

    assert as_nobody(open_root, arena_copy) == ["allowed", "allowed"]
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", shm_dir=open_root)
    try:
        (arena,) = [p for p in daemon.shm_dir.iterdir() if p.name.startswith(FILE_PREFIX)]
        assert as_nobody(arena.parent, arena) == ["denied", "denied"]
    finally:
        daemon.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_group_may_map_arenas(tmp_path: Path, tiny_fp8: Path, open_root: Path) -> None:
    import grp

    group = grp.getgrgid(NOBODY).gr_name if NOBODY in {g.gr_gid for g in grp.getgrall()} else None
    if group is None:
        pytest.skip("no group 65534 here")
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", "--shm-group", group, shm_dir=open_root
    )
    try:
        (arena,) = [p for p in daemon.shm_dir.iterdir() if p.name.startswith(FILE_PREFIX)]
        assert stat.S_IMODE(daemon.shm_dir.stat().st_mode) == 0o750
        assert stat.S_IMODE(arena.stat().st_mode) == 0o640
        assert arena.stat().st_gid == NOBODY
        code = "print(len(open(sys.argv[1], 'rb').read(16)))"
        assert run_as(NOBODY, NOBODY, code, str(arena), groups=(NOBODY,)) == "16"
    finally:
        daemon.stop()


def test_planted_files_neither_block_nor_mislead_startup(tmp_path: Path, tiny_fp8: Path) -> None:
    """A FIFO, a symlink to a file of someone else's and a file another user owns, all named
    like arenas, in the daemon's directory and in the root: startup finishes, removes none."""
    root = tmp_path / "shm"
    private = arena_dir_path(root)
    private.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = []
    for directory in (root, private):
        fifo = directory / f"{FILE_PREFIX}fifo"
        os.mkfifo(fifo)
        link = directory / f"{FILE_PREFIX}link"
        link.symlink_to(victim)
        hidden_link = directory / f".{FILE_PREFIX}link"
        hidden_link.symlink_to(victim)
        planted += [fifo, link, hidden_link]
        if os.geteuid() == 0:
            foreign = directory / f"{FILE_PREFIX}foreign"
            foreign.write_bytes(b"theirs")
            os.chown(foreign, NOBODY, NOBODY)
            planted.append(foreign)
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", shm_dir=root, timeout_s=30)
    try:
        assert httpx.get(f"{daemon.url}/health").status_code == 200
        assert all(p.is_symlink() or p.exists() for p in planted)
        assert victim.read_bytes() == b"precious"
    finally:
        daemon.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another user's directory")
def test_someone_elses_arena_directory_is_refused(tmp_path: Path, tiny_fp8: Path) -> None:
    root = tmp_path / "shm"
    private = arena_dir_path(root)
    private.mkdir(parents=True, mode=0o777)
    os.chown(private, NOBODY, NOBODY)  # pre-created by another user to read our weights
    with pytest.raises(RuntimeError, match="belongs to uid 65534"):
        start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", shm_dir=root, timeout_s=30)


def test_a_half_created_arena_of_a_killed_daemon_is_removed(tmp_path: Path, tiny_fp8: Path) -> None:
    """SIGKILL between creating the hidden file and naming it leaves it behind; the next
    daemon of this user removes it."""
    root = tmp_path / "shm"
    code = (
        "import os, signal, sys, pathlib\n"
        "from service.memory.shm import ArenaDir\n"
        "d = ArenaDir.prepare(pathlib.Path(sys.argv[1]))\n"
        "fd = os.open('.weight-cache-dead-r0-0000', os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600,"
        " dir_fd=d.fd)\n"
        "os.posix_fallocate(fd, 0, 8 << 20)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root.mkdir()
    done = subprocess.run([sys.executable, "-c", code, str(root)], timeout=60, check=False)
    assert done.returncode == -signal.SIGKILL
    half = arena_dir_path(root) / ".weight-cache-dead-r0-0000"
    assert half.exists()
    daemon = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny", shm_dir=root)
    try:
        assert not half.exists()
        assert "removed stale shared-memory arena" in daemon.log.read_text()
    finally:
        daemon.stop()


def test_auth_under_load_keeps_health(tmp_path: Path, tiny_fp8: Path) -> None:
    token = "s3cret-token-0123456789"
    daemon = start_daemon(
        tmp_path, [tiny_fp8], "--model-id", "tiny", env={"WEIGHT_CACHE_TOKEN": token}
    )
    try:
        with HealthProbe(daemon.url) as probe, httpx.Client(base_url=daemon.url) as client:
            codes = {
                client.get(
                    "/v1/inventory", headers={"Authorization": f"Bearer {'x' * i}"}
                ).status_code
                for i in range(1, 300)
            }
        assert codes == {401}
        probe.assert_answered()
    finally:
        daemon.stop()

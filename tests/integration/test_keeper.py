"""Arenas that outlive the daemon, on the CPU twin, with real processes and real signals: an
engine attached and computing while the daemon is killed and started again; the new daemon
takes the models over from the keeper without reading a checkpoint, checks their bytes, takes
the engine's lease over; nothing is left once the last holder goes."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from harness.cli import run_cli
from harness.daemon_process import (
    ComputingEngine,
    KeptDaemons,
    free_port,
    keeper_status,
)
from harness.waiting import wait_for
from service.memory.shm import arena_dir_path


@pytest.fixture
def checkpoint(tmp_path: Path, tiny_fp8: Path, copy_of) -> Path:
    """A copy of the tiny checkpoint, this test's own."""
    copied: Path = copy_of(tiny_fp8)
    return copied


def test_kill_restart_adopt_and_take_the_lease_over(tmp_path: Path, checkpoint: Path) -> None:
    with KeptDaemons(tmp_path, checkpoint) as kept:
        run, shm, first = kept.run, kept.shm, kept.first
        engine = ComputingEngine(first.url, "tiny", checkpoint)
        try:
            assert engine.attached["via"] == "descriptor" and engine.attached["zero_copy"]
            lease = engine.attached["lease"]
            wait_for(lambda: keeper_status(run) is not None and keeper_status(run).leases == 1)
            assert keeper_status(run).models == ["tiny"] and keeper_status(run).arenas == 1
            files = sorted(arena_dir_path(shm).iterdir())

            first.stop(signal.SIGKILL)
            # The engine goes on computing the same outputs, waiting for a daemon.
            before = engine.ask()["iterations"]
            wait_for(lambda: engine.ask()["unanswered"] >= 2)
            status = engine.ask()
            assert status["iterations"] > before and status["mismatches"] == 0
            assert status["lost"] is None
            assert keeper_status(run).daemon_pid is None and keeper_status(run).models == ["tiny"]

            # A new daemon takes the model over: no load runs (the only code that reads weights).
            second = kept.restart()
            log = second.log.read_text()
            assert "adopted tiny from the keeper" in log and "checksums verified" in log
            assert "loading tiny" not in log
            metrics = httpx.get(f"{second.url}/metrics").text
            assert "weight_cache_load_duration_seconds_count 0.0" in metrics
            # the lease taken over counts, so that granted less ended is what is active
            assert 'weight_cache_leases_granted_total{via="keeper"} 1.0' in metrics
            assert "weight_cache_leases_active 1.0" in metrics
            assert sorted(arena_dir_path(shm).iterdir()) == files  # the same file, not a new one
            model = httpx.get(f"{second.url}/v1/models/tiny").json()
            assert model["state"] == "ready" and model["active_leases"] == 1
            leases = httpx.get(f"{second.url}/v1/leases").json()
            assert [x["id"] for x in leases] == [lease]
            new_boot = httpx.get(f"{second.url}/health").json()["boot_id"]
            assert leases[0]["boot_id"] == new_boot != engine.attached["boot"]

            # The engine's renewals just work: same lease, the new daemon answering.
            wait_for(lambda: engine.ask()["boot"] == new_boot)
            status = engine.ask()
            assert status["lost"] is None and status["mismatches"] == 0

            # A new engine attaches to the adopted arena too.
            other = ComputingEngine(second.url, "tiny", checkpoint)
            assert other.attached["via"] == "descriptor"
            other.close()

            # The last holder goes: released, unloaded, let go by the keeper; nothing left.
            assert engine.close()["closed"]
            wait_for(lambda: httpx.get(f"{second.url}/v1/leases").json() == [])
            assert httpx.delete(f"{second.url}/v1/models/tiny").status_code == 204
            wait_for(lambda: keeper_status(run).arenas == 0 and keeper_status(run).leases == 0)
            assert list(arena_dir_path(shm).iterdir()) == []
        finally:
            engine.kill()


def test_a_changed_arena_is_not_adopted_but_loaded_again(tmp_path: Path, checkpoint: Path) -> None:
    """Bytes written into the arena while no daemon runs: the new daemon finds the checksum
    wrong, lets the arena go, and loads the model from its checkpoint."""
    with KeptDaemons(tmp_path, checkpoint) as kept:
        wait_for(lambda: kept.keeper() is not None and kept.keeper().arenas == 1)
        kept.first.stop(signal.SIGKILL)
        (arena,) = arena_dir_path(kept.shm).iterdir()
        with arena.open("r+b") as f:
            f.seek(300)
            byte = f.read(1)
            f.seek(300)
            f.write(bytes([byte[0] ^ 0xFF]))
        second = kept.restart()
        log = second.log.read_text()
        assert "not adopting tiny from the keeper" in log and "checksum" in log
        assert httpx.get(f"{second.url}/v1/models/tiny").json()["state"] == "ready"
        (fresh,) = arena_dir_path(kept.shm).iterdir()
        assert fresh != arena  # loaded anew; the changed file is gone
        wait_for(lambda: kept.keeper().arenas == 1)  # the new arena is kept instead


def test_upgrade_stop_then_start_keeps_the_models(tmp_path: Path, checkpoint: Path) -> None:
    """The documented upgrade: SIGTERM the daemon, start the new one; the models come back
    from the keeper (the stop leaves them to it)."""
    with KeptDaemons(tmp_path, checkpoint) as kept:
        wait_for(lambda: kept.keeper() is not None and kept.keeper().arenas == 1)
        kept.first.stop(signal.SIGTERM)
        assert kept.first.process.returncode in (0, -signal.SIGTERM)
        assert len(list(arena_dir_path(kept.shm).iterdir())) == 1  # left to the keeper
        assert "adopted tiny from the keeper" in kept.restart().log.read_text()
    assert list(arena_dir_path(kept.shm).iterdir()) == []  # the keeper let go when it stopped


def test_external_keeper_is_required(tmp_path: Path, tiny_fp8: Path) -> None:
    run = tmp_path / "run"
    out = run_cli(
        "serve", "--model", str(tiny_fp8), "--port", str(free_port()), "--device", "cpu",
        "--shm-dir", str(tmp_path), "--run-dir", str(run), "--keeper", "external",
    )  # fmt: skip
    assert out.returncode == 1
    assert "[keeper_unavailable] no keeper answers on" in out.stderr
    assert keeper_status(run) is None  # none was started


def test_a_checkpoint_changed_on_disk_is_loaded_again(tmp_path: Path, checkpoint: Path) -> None:
    """The checkpoint's files touched while no daemon runs (a new export in place, say): the
    kept arena no longer stands for them; the new daemon loads the model again and leaves no
    file of the old one behind."""
    import os

    with KeptDaemons(tmp_path, checkpoint) as kept:
        wait_for(lambda: kept.keeper() is not None and kept.keeper().arenas == 1)
        kept.first.stop(signal.SIGKILL)
        (old,) = arena_dir_path(kept.shm).iterdir()
        for f in checkpoint.glob("*.safetensors"):
            os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
        log = kept.restart().log.read_text()
        assert "not adopting tiny from the keeper" in log and "changed on disk" in log
        assert "loading tiny" in log
        (fresh,) = arena_dir_path(kept.shm).iterdir()
        assert fresh != old

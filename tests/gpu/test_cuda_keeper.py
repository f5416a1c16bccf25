"""Shareable CUDA arenas for real (run on a GPU): the same bytes as the legacy path, the daemon's
footprint, an engine computing through a kill -9 and restart of the daemon that takes its model
and its lease over from the keeper, the keeper's descriptors alone keeping the memory (with no
CUDA context of its own), and an engine in its own PID namespace attaching."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from harness.daemon_process import (
    ComputingEngine,
    InProcessDaemon,
    KeptDaemons,
    keeper_status,
    make_settings,
    start_daemon,
)
from harness.waiting import wait_for
from protocol.devices import Placement, cuda_uuid
from protocol.schemas.manifest import DeviceKind
from service.demo import write_demo_checkpoint
from service.memory.arena import CudaArena, VmmArena
from service.registry.loader import LoadRequest, Progress, load_model

pytestmark = pytest.mark.gpu
GIB = 1 << 30


def nvml_pids(index: int = 0) -> set[int]:
    """Processes holding a CUDA context on GPU ``index``, per NVML."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByUUID(cuda_uuid(index))
    return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}


@pytest.mark.parametrize("scheme", ["fp8", "fp8-pc-pt"])
def test_fd_arena_holds_the_legacy_arenas_bytes(tiny_fp8: Path, tiny_pc: Path, scheme: str) -> None:
    """The same load into a shareable allocation and into a legacy IPC allocation: every byte
    and every checksum equal, and the shareable one outside torch's pool."""
    path = tiny_fp8 if scheme == "fp8" else tiny_pc
    request = LoadRequest.unmanaged("m", path, [Placement(DeviceKind.cuda, 0)])
    allocated = torch.cuda.memory_allocated(0)
    (fd_rank,) = load_model(request, Progress())
    assert torch.cuda.memory_allocated(0) - allocated < fd_rank.arena.nbytes
    (ipc_rank,) = load_model(dataclasses.replace(request, cuda_handles="ipc"), Progress())
    try:
        assert isinstance(fd_rank.arena, VmmArena) and isinstance(ipc_rank.arena, CudaArena)
        assert fd_rank.digest is not None and ipc_rank.digest is None
        assert fd_rank.manifest.tensors == ipc_rank.manifest.tensors  # checksums included
        for entry in fd_rank.manifest.tensors:
            a = fd_rank.arena.base[entry.offset : entry.offset + entry.nbytes]
            b = ipc_rank.arena.base[entry.offset : entry.offset + entry.nbytes]
            assert torch.equal(a, b), entry.name
    finally:
        fd_rank.arena.release()
        ipc_rank.arena.release()


def test_daemon_footprint_is_its_weights_plus_at_most_a_gib(tmp_path: Path) -> None:
    """Idle after a GPU load, the daemon's process holds at most its arenas plus 1 GiB (CUDA
    context, what torch keeps), per NVML, and the inventory reports that footprint."""
    checkpoint = write_demo_checkpoint(tmp_path / "qwen", "fp8", "qwen2.5-0.5b")
    daemon = start_daemon(tmp_path, [checkpoint], device="cuda:0", timeout_s=600)
    try:
        inventory = httpx.get(f"{daemon.url}/v1/inventory").json()
        gpu = inventory["devices"][0]
        resident = inventory["cache_bytes"]
        assert resident > 0.5 * GIB
        if gpu["process_memory_source"].startswith("nvml"):
            assert daemon.process.pid in nvml_pids()
            assert gpu["process_memory"] <= resident + GIB, gpu
        else:  # NVML cannot see the process here: the inventory says so and what it counts
            assert gpu["process_memory"] >= resident
            pytest.skip(f"NVML cannot see the daemon: {gpu['process_memory_source']}")
    finally:
        daemon.stop()


def test_kill_restart_adopt_with_an_engine_computing(tmp_path: Path, tiny_fp8: Path) -> None:
    """kill -9 of the daemon under an engine computing on the GPU: identical outputs throughout;
    a new daemon takes the model over from the keeper (no load, digest checked) and the
    engine's lease with it; the keeper holds no CUDA context; once the engine and the model
    are gone, the memory is given back."""
    with KeptDaemons(tmp_path, tiny_fp8, "cuda:0") as kept:
        run, first = kept.run, kept.first
        engine = ComputingEngine(first.url, "tiny", tiny_fp8, "cuda:0")
        try:
            assert engine.attached["via"] == "descriptor" and engine.attached["zero_copy"]
            wait_for(lambda: keeper_status(run).leases == 1 and keeper_status(run).arenas == 1)
            keeper_pid = keeper_status(run).pid
            assert keeper_pid not in nvml_pids()  # descriptors only: no CUDA context
            first.stop(signal.SIGKILL)
            before = engine.ask()["iterations"]
            wait_for(lambda: engine.ask()["unanswered"] >= 2)  # its renewals go unanswered
            wait_for(lambda: engine.ask()["iterations"] > before)  # and it computes on
            status = engine.ask()
            assert status["mismatches"] == 0 and not status["lost"]

            second = kept.restart()
            log = second.log.read_text()
            assert "adopted tiny from the keeper" in log and "loading tiny" not in log
            assert (
                "weight_cache_load_duration_seconds_count 0.0"
                in httpx.get(f"{second.url}/metrics").text
            )
            boot = httpx.get(f"{second.url}/health").json()["boot_id"]
            assert [x["id"] for x in httpx.get(f"{second.url}/v1/leases").json()] == [
                engine.attached["lease"]
            ]
            wait_for(lambda: engine.ask()["boot"] == boot)
            status = engine.ask()
            assert status["mismatches"] == 0 and not status["lost"]
            assert keeper_status(run).pid == keeper_pid not in nvml_pids()

            assert engine.close()["closed"]  # the engine's mapping and context are gone
            free_before = torch.cuda.mem_get_info(0)[0]
            assert httpx.delete(f"{second.url}/v1/models/tiny").status_code == 204
            wait_for(lambda: keeper_status(run).arenas == 0)
            wait_for(lambda: torch.cuda.mem_get_info(0)[0] > free_before)  # freed at last
        finally:
            engine.kill()


def test_the_keepers_descriptor_alone_keeps_the_memory(tmp_path: Path, tiny_pc: Path) -> None:
    """No engine: the daemon killed, only the keeper's descriptor left (no mapping, no context
    anywhere). A new daemon adopts the arena and its digest, taken at load, still matches."""
    with KeptDaemons(tmp_path, tiny_pc, "cuda:0") as kept:
        wait_for(lambda: kept.keeper() is not None and kept.keeper().arenas == 1)
        kept.first.stop(signal.SIGKILL)
        wait_for(lambda: kept.first.process.pid not in nvml_pids())
        log = kept.restart().log.read_text()
        assert "adopted tiny from the keeper" in log and "checksums verified" in log
        # An engine attaches to the adopted allocation and reads the loaded bytes.
        assert kept.second is not None
        engine = ComputingEngine(kept.second.url, "tiny", tiny_pc, "cuda:0")
        assert engine.attached["zero_copy"] and engine.close()["closed"]


def test_an_engine_in_its_own_pid_namespace_attaches(tmp_path: Path, tiny_fp8: Path) -> None:
    """The engine in a PID namespace of its own (as in another container): it names itself
    by its own pid, the daemon sees another; the handle socket relates the two and passes the
    descriptor; the engine reads the daemon's bytes zero-copy."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to make a PID namespace")
    probe = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.strip()}")
    with InProcessDaemon(make_settings(tmp_path, [tiny_fp8], device="cuda:0")) as served:
        manifest = served.daemon.model("tiny").ranks[0].manifest
        child = subprocess.Popen(
            [
                unshare,
                "--pid",
                "--fork",
                "--mount-proc",
                sys.executable,
                "-m",
                "tests.gpu.cuda_engine_child",
                served.url,
                "tiny",
                str(tiny_fp8),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert child.stdin is not None and child.stdout is not None
        try:
            report = json.loads(child.stdout.readline())
            assert report["pid"] == 1  # its own view: the first process of its namespace
            assert report["via"] == "descriptor" and report["zero_copy"]
            for entry in manifest.tensors:
                assert report["tensors"][entry.name]["checksum"] == entry.checksum, entry.name
            (lease,) = served.daemon.leases.active.values()
            assert lease.client_pid == 1
        finally:
            child.stdin.close()
            assert child.wait(60) == 0
        assert served.daemon.leases.count() == 0  # released on close

"""On a GPU: after ``kill -9`` of a process holding GPU memory, a released engine's wait
(:func:`engine_client.freed_memory.wait_for_this_gpu`) returns only once that memory is free
again, which vLLM's memory profiling needs (its snapshot must not see memory still being
freed)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from engine_client.freed_memory import wait_for_this_gpu

pytestmark = pytest.mark.gpu
HELD = 8 << 30
HOLDER = (
    "import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, "
    "device='cuda'); torch.cuda.synchronize(); print('ready', flush=True); time.sleep(600)"
)


def test_the_wait_ends_once_a_killed_processs_memory_is_free() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")  # this process's context: NVML lists it
    free_before = torch.cuda.mem_get_info()[0]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(HELD)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
    assert torch.cuda.mem_get_info()[0] <= free_before - HELD
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)  # gone, as the daemon's reaper sees it
    wait_for_this_gpu(timeout_s=60)
    assert torch.cuda.mem_get_info()[0] >= free_before - (256 << 20)

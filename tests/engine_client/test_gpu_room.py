"""Reading NVML's process list (engine_client/gpu_room.py) as the driver answers it, with a
stand-in for the driver's answers (the GPU tests read the real one): this process's bytes, a
list without this process (another PID namespace), a process whose bytes NVML does not count,
a driver that stops answering; and what a standby gave back between two readings."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from engine_client.gpu_room import DeviceProcesses, given_back


class Driver:
    def __init__(self, listed: list[tuple[int, int | None]] | None) -> None:
        self.listed = listed

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        if self.listed is None:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.listed]

    def nvmlShutdown(self) -> None:
        pass


def test_this_process_and_the_others() -> None:
    driver = Driver([(1, 5 << 30), (os.getpid(), 700 << 20)])
    device = DeviceProcesses(driver, handle=None)
    assert device.own() == 700 << 20
    assert device.used() == {1: 5 << 30, os.getpid(): 700 << 20}
    driver.listed = [(os.getpid(), None)]  # NVML does not count it (some containers)
    assert device.own() is None
    driver.listed = [(1, 5 << 30)]  # PIDs of another namespace: nothing to tell
    assert device.used() is None and device.own() is None
    driver.listed = None
    assert device.used() is None


def test_what_a_standby_gave_back() -> None:
    before = {"GPU-a": 35 << 30, "GPU-b": 2 << 30}
    after = {"GPU-a": 1 << 30, "GPU-b": 2 << 30}
    assert given_back(before, after) == {"GPU-a": 34 << 30}
    assert given_back(None, after) == {} and given_back(before, None) == {}

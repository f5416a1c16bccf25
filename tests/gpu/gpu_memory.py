"""GPU memory held by each process, as the driver counts it (CUDA context, allocator pools,
imported memory mapped into it): NVML through ``nvidia-ml-py`` where it is installed (it never
creates a CUDA context in the asking process), else ``nvidia-smi --query-compute-apps``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Mapping

MIB = 1 << 20


def parse_compute_apps(csv: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``
    output (MiB) as bytes per pid, summed over GPUs; rows it cannot read are left out."""
    used: dict[int, int] = {}
    for row in csv.splitlines():
        fields = [f.strip() for f in row.split(",")]
        if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        pid = int(fields[0])
        used[pid] = used.get(pid, 0) + int(fields[1]) * MIB
    return used


def _by_nvml() -> dict[int, int] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        used: dict[int, int] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used[proc.pid] = used.get(proc.pid, 0) + int(proc.usedGpuMemory or 0)
        return used
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _by_nvidia_smi() -> dict[int, int] | None:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    query = [tool, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(done.stdout)


def used_by_pid() -> dict[int, int] | None:
    """Bytes of GPU memory per process on every GPU; None where neither NVML nor nvidia-smi
    answers (no GPU driver)."""
    by_nvml = _by_nvml()
    return by_nvml if by_nvml is not None else _by_nvidia_smi()


def held_by(groups: Mapping[str, Iterable[int]], used: Mapping[int, int]) -> dict[str, int]:
    """Bytes each named group of processes holds (a process the driver does not list holds
    none): e.g. ``{"daemon": [pid], "A1.EngineCore": [pid]}``."""
    return {name: sum(used.get(pid, 0) for pid in pids) for name, pids in groups.items()}

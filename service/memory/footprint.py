"""The daemon's whole memory footprint on a device, not only its arenas: on a GPU, what NVML
counts for this process (its CUDA context, torch's pool and the arenas); where NVML cannot see
the process, what the daemon knows it holds, saying so."""

from __future__ import annotations

import os

import torch


def nvml_process_memory(uuid: str) -> tuple[int | None, str]:
    """(bytes NVML counts for this process on GPU ``uuid``, or None; where the figure is from,
    or why there is none)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception as exc:  # not installed, no driver access: unknown, not an error
        return None, f"NVML unavailable ({type(exc).__name__})"
    for process in processes:
        if process.pid == os.getpid():
            used = process.usedGpuMemory
            if used is None:
                return None, "NVML does not report per-process memory here"
            return int(used), "nvml: this process's GPU memory"
    return None, "NVML lists no process with this daemon's pid (another PID namespace?)"


def gpu_footprint(uuid: str, index: int, arenas: int, in_use: bool) -> tuple[int | None, str]:
    """The daemon's footprint on GPU ``index``: NVML's figure, else the arenas plus torch's
    pool (the CUDA context not counted), else what is known."""
    used, source = nvml_process_memory(uuid)
    if used is not None:
        return used, source
    if not in_use:
        return arenas, f"arenas only ({source})"
    pool = int(torch.cuda.memory_reserved(index))
    return arenas + pool, f"arenas and torch's pool, without the CUDA context ({source})"

"""The devices arenas live on, and how both sides name them.

GPUs are named by UUID (``GPU-...``): the daemon and an engine may number them differently
(``CUDA_VISIBLE_DEVICES``), so an engine finds its own index for a leased arena by UUID. The CPU
twin is named by the kernel's boot id, which every process and container on one host shares.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from protocol.devices import Placement
from protocol.processes import process_status
from protocol.schemas.inventory import DeviceInfo
from protocol.schemas.manifest import DeviceIdentity, DeviceKind
from service.memory.footprint import gpu_footprint


def resolve_placements(device: str, tp_size: int) -> list[Placement]:
    """Placement of each rank: ``cuda`` puts rank r on GPU r, ``cuda:N`` all ranks on GPU N,
    ``auto`` is ``cuda`` when a GPU is present, ``cpu`` host shared memory."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return [Placement(DeviceKind.cpu)] * tp_size
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    count = torch.cuda.device_count()
    if device == "cuda":
        if tp_size > count:
            raise ValueError(f"tp_size {tp_size} needs {tp_size} GPUs, {count} visible")
        return [Placement(DeviceKind.cuda, r) for r in range(tp_size)]
    index = int(device.split(":", 1)[1])
    if index >= count:
        raise ValueError(f"device {device} does not exist ({count} GPUs visible)")
    return [Placement(DeviceKind.cuda, index)] * tp_size


def places_on_gpu(device: str, index: int) -> bool:
    """Whether a daemon started with ``--device device`` holds arenas on GPU ``index``: ``cuda``
    on any, ``cuda:N`` on GPU N only, ``auto`` on any where a GPU is present, ``cpu`` on none."""
    if device == "auto":
        return torch.cuda.is_available()
    if device == "cuda":
        return True
    return device == f"cuda:{index}"


def _free_without_a_context(uuid: str) -> int | None:
    """Free memory from NVML (nvidia-ml-py, when installed): asking torch would create a CUDA
    context, hundreds of MiB, on every GPU the daemon never uses."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    except Exception:  # not installed, no driver access: unknown, not an error
        return None


def device_infos(
    device: str, shm_dir: Path, in_use: set[int], held: dict[int | None, int] | None = None
) -> list[DeviceInfo]:
    """Every device the daemon may place arenas on, with its memory and the daemon's footprint
    there (``held``: arena bytes by CUDA index, None for host shared memory). Free memory comes
    from torch only for GPUs already holding arenas (``in_use``), else from NVML if it can."""
    held = held or {}
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        usage = shutil.disk_usage(shm_dir)
        info = _info(Placement(DeviceKind.cpu).identity(), usage.total, usage.free)
        return [
            info.model_copy(
                update={
                    "process_memory": held.get(None, 0),
                    "process_memory_source": "shared-memory arena files",
                }
            )
        ]
    indices = (
        range(torch.cuda.device_count()) if device == "cuda" else [int(device.split(":", 1)[1])]
    )
    infos = []
    for index in indices:
        ident = Placement(DeviceKind.cuda, index).identity()
        assert ident.uuid is not None
        free = (
            torch.cuda.mem_get_info(index)[0]
            if index in in_use
            else _free_without_a_context(ident.uuid)
        )
        info = _info(ident, torch.cuda.get_device_properties(index).total_memory, free)
        used, source = gpu_footprint(ident.uuid, index, held.get(index, 0), index in in_use)
        infos.append(
            info.model_copy(update={"process_memory": used, "process_memory_source": source})
        )
    return infos


def _info(ident: DeviceIdentity, total: int, free: int | None) -> DeviceInfo:
    return DeviceInfo(**ident.model_dump(exclude={"index"}), total_memory=total, free_memory=free)


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process, and the same one if its start time is
    known (guards against PID reuse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    status = process_status(pid)
    if status is None:
        return True  # no /proc view; trust kill(0)
    if status.ended:
        return False
    return start_ticks is None or status.start == start_ticks


def use_plain_cuda_allocations() -> None:
    """Turn off expandable segments for this process: opening an expandable-segment handle costs
    time in proportion to its size, a plain allocation's does not (arenas are opened per lease)."""
    if not torch.cuda.is_available():
        return
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (set_settings or torch.cuda.memory._set_allocator_settings)("expandable_segments:False")


def collect_ipc_handles() -> None:
    """Free CUDA memory kept alive for IPC consumers that no longer hold it (after leases end)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

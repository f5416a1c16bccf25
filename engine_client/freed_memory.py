"""A released engine waits for the GPU memory of the engine it replaces to come back, before
vLLM takes its memory snapshot.

The daemon releases a parked engine as soon as the process of the engine it replaces is gone,
but the driver frees that process's memory seconds after: a snapshot taken meanwhile sees
memory that is freed while vLLM profiles, and vLLM's check that free memory has not grown
while it profiles fails ("Error in memory profiling"). So, before the snapshot:

1. while NVML lists a process on this GPU that has ended (its memory not yet freed), wait; this
   is read only where NVML's PIDs are this process's PID namespace (it lists this process);
2. then wait until the GPU's free memory has stopped growing for ``quiet_s``.

Both end at ``timeout_s``, with a warning: the engine then starts as it would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine_client.gpu_room import DeviceProcesses
from protocol.logsafe import get_logger
from protocol.processes import process_ended

log = get_logger(__name__)

GROWTH_BYTES = 64 << 20  # free memory that grows less than this between reads is settled
POLL_S = 0.05


def nvml_gpu_pids(device_index: int) -> Callable[[], list[int] | None]:
    """A reader of the PIDs NVML lists on CUDA device ``device_index`` (as torch numbers it),
    NVML and the device's handle opened once; it answers None where NVML cannot be read or its
    PIDs are not of this PID namespace (this process is not among them)."""
    from protocol.devices import cuda_uuid

    try:
        processes = DeviceProcesses.open(cuda_uuid(device_index))
    except Exception:  # no CUDA device by that number: nothing to tell
        return lambda: None
    if processes is None:
        return lambda: None

    def listed() -> list[int] | None:
        used = processes.used()
        return None if used is None else list(used)

    return listed


def wait_for_freed_memory(
    free_bytes: Callable[[], int],
    gpu_pids: Callable[[], list[int] | None],
    timeout_s: float = 30.0,
    quiet_s: float = 0.5,
    poll_s: float = POLL_S,
) -> float:
    """Wait until no ended process holds memory on the GPU and its free memory (``free_bytes``)
    has grown by less than :data:`GROWTH_BYTES` for ``quiet_s``; the seconds waited."""
    start = time.monotonic()
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        pids = gpu_pids()
        ending = [pid for pid in pids or () if process_ended(pid)]
        if not ending:
            break
        log.info("waiting for the GPU memory of ended process(es) %s to be freed", ending)
        time.sleep(poll_s)
    last, quiet_since = free_bytes(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = free_bytes()
        if now - last >= GROWTH_BYTES:
            quiet_since = time.monotonic()
        last = max(last, now)
        if time.monotonic() - quiet_since >= quiet_s:
            return time.monotonic() - start
    log.warning(
        "the GPU's free memory was still changing after %.0f s: starting anyway (vLLM's memory "
        "profiling may then fail)",
        timeout_s,
    )
    return time.monotonic() - start


def wait_for_this_gpu(timeout_s: float = 30.0) -> float:
    """:func:`wait_for_freed_memory` on this process's current CUDA device."""
    import torch

    index = torch.cuda.current_device()
    waited = wait_for_freed_memory(
        lambda: int(torch.cuda.mem_get_info(index)[0]),
        nvml_gpu_pids(index),
        timeout_s,
    )
    log.info("GPU memory settled %.2f s after the release", waited)
    return waited

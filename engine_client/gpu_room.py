"""GPU memory as the driver counts it, per process and per device, read through NVML (it never
creates a CUDA context in the asking process): what a warm standby gave back when it fell
asleep, and waiting, once it is released, until that much is free again before it wakes.

Where the engine that ended was large (a GPU shared tightly), the driver frees its memory a
little after its process is gone; waking into memory that is not free yet would fail vLLM's
allocation. Where there is room already (the usual case) the wait costs one NVML read.
Everything answers None where NVML cannot be read or does not list these processes (another
PID namespace): the standby then wakes at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection, Iterator
from types import ModuleType
from typing import Any

from protocol.logsafe import get_logger

log = get_logger(__name__)

MARGIN_BYTES = 256 << 20  # room asked beyond what the engine gave back (allocator rounding)
POLL_S = 0.01


def _pynvml() -> ModuleType | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        try:  # vLLM carries a copy
            from vllm.third_party import pynvml
        except ImportError:
            return None
    return pynvml  # type: ignore[no-any-return]


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    nvml = _pynvml()
    if nvml is None:
        yield None
        return
    try:
        nvml.nvmlInit()
    except Exception:  # no driver access here
        yield None
        return
    try:
        yield nvml
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _devices(nvml: Any) -> list[tuple[str, Any]]:
    handles = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        handles.append((uuid.decode() if isinstance(uuid, bytes) else str(uuid), handle))
    return handles


def held_by(pids: Collection[int]) -> dict[str, int] | None:
    """GPU bytes the processes ``pids`` hold, per device UUID (devices where they hold none
    left out); None where NVML cannot say (not readable, or none of ``pids`` listed)."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            held: dict[str, int] = {}
            for uuid, handle in _devices(nvml):
                for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid in pids and proc.usedGpuMemory:
                        held[uuid] = held.get(uuid, 0) + int(proc.usedGpuMemory)
        except Exception as exc:
            log.debug("NVML: %s", exc)
            return None
        return held or None


def given_back(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    """Bytes per device that an engine gave back between two readings of :func:`held_by`."""
    if before is None or after is None:
        return {}
    return {uuid: b - after.get(uuid, 0) for uuid, b in before.items() if b > after.get(uuid, 0)}


def wait_for_room(needed: dict[str, int], timeout_s: float = 30.0) -> float:
    """Wait until every device in ``needed`` has that many bytes (and a margin) free; the
    seconds waited. Gives up after ``timeout_s`` with a warning (the wake may then fail)."""
    start = time.monotonic()
    if not needed:
        return 0.0
    with _nvml() as nvml:
        if nvml is None:
            return 0.0
        handles = {uuid: h for uuid, h in _devices(nvml) if uuid in needed}
        while True:
            short = {
                uuid: needed[uuid] + MARGIN_BYTES - int(nvml.nvmlDeviceGetMemoryInfo(h).free)
                for uuid, h in handles.items()
            }
            short = {uuid: b for uuid, b in short.items() if b > 0}
            if not short:
                return time.monotonic() - start
            if time.monotonic() - start >= timeout_s:
                log.warning(
                    "weight-cache standby: %s still short of %s bytes after %.0f s: waking anyway",
                    ", ".join(short),
                    ", ".join(str(b) for b in short.values()),
                    timeout_s,
                )
                return time.monotonic() - start
            time.sleep(POLL_S)


class DeviceProcesses:
    """The processes NVML lists on one GPU and the bytes each holds there (its context, its
    allocator pools, its cuMem allocations; not memory it maps from another process), NVML and
    the device's handle opened once for the reader's life. :meth:`open` answers None where NVML
    cannot be read or does not list this process (its PIDs are of another PID namespace)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle

    @classmethod
    def open(cls, uuid: str) -> DeviceProcesses | None:
        nvml = _pynvml()
        if nvml is None:
            return None
        try:
            nvml.nvmlInit()
            reader = cls(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid))
        except Exception as exc:
            log.debug("NVML: %s", exc)
            return None
        if reader.used() is None:
            reader.close()
            return None
        return reader

    def used(self) -> dict[int, int | None] | None:
        """Bytes per PID listed (None where NVML does not say); None if the driver stopped
        answering or this process is not listed."""
        try:
            listed = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception as exc:
            log.debug("NVML: %s", exc)
            return None
        used = {
            int(p.pid): None if p.usedGpuMemory is None else int(p.usedGpuMemory) for p in listed
        }
        return used if os.getpid() in used else None

    def own(self) -> int | None:
        """This process's bytes on the device."""
        used = self.used()
        return None if used is None else used[os.getpid()]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()

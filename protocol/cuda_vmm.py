"""Every call into the CUDA driver's virtual memory management, for both sides: shareable
allocations (``cuMemCreate``) exported and imported as POSIX file descriptors, mapped into this
process and wrapped as a torch byte tensor without a copy.

NVIDIA's ``cuda-bindings`` (``cuda.bindings.driver``, extra ``cuda``) makes the calls; it is
imported on first use, so a host without it (or without a GPU) never needs it. Each call's
failure is raised here as :class:`~protocol.errors.CudaDriverError` (out of memory as
:class:`~protocol.errors.InsufficientMemoryError`), naming the call and the driver's result.

An allocation lives while any handle, descriptor or mapping of it exists, in any process
(``cuMemRelease``: "the memory will be freed when all outstanding mappings ... are unmapped and
when all outstanding references to the handle (including its shareable counterparts) are also
released"). So a mapping here keeps its allocation alive after its handle is released, and a
descriptor held anywhere keeps it alive with no CUDA context at all.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from protocol.errors import CudaDriverError, InsufficientMemoryError

_lock = threading.RLock()
_state: dict[str, Any] = {}  # "driver": the module, once initialised; contexts by ordinal


def _driver() -> Any:
    with _lock:
        loaded = _state.get("driver")
        if loaded is not None:
            return loaded
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise CudaDriverError(
                "cuda-bindings is not installed (the package's cuda extra): pip install "
                "'cuda-bindings>=13.0,<14'",
                call="import",
            ) from exc
        _checked(driver, "cuInit", 0)
        _state["driver"] = driver
        return driver


def _call(name: str, *args: Any) -> Any:
    """``cuda.bindings.driver.<name>(*args)``, its result checked; returns its outputs (one
    value, a tuple of several, or None)."""
    return _checked(_state.get("driver") or _driver(), name, *args)


def _checked(driver: Any, name: str, *args: Any) -> Any:
    try:
        out = getattr(driver, name)(*args)
    except RuntimeError as exc:  # the driver library itself cannot be loaded
        raise CudaDriverError(f"{name}: {exc}", call=name) from exc
    result, values = out[0], out[1:]
    if result != driver.CUresult.CUDA_SUCCESS:
        named = driver.cuGetErrorName(result)
        what = named[1].decode() if named[0] == driver.CUresult.CUDA_SUCCESS else str(result)
        if result == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise InsufficientMemoryError(f"{name}: the GPU is out of memory ({what})", call=name)
        raise CudaDriverError(f"{name} failed: {what}", call=name, result=what)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@contextmanager
def _on_device(ordinal: int) -> Iterator[Any]:
    """The device's primary context (the one torch uses) current on this thread meanwhile."""
    driver = _driver()
    with _lock:
        contexts: dict[int, Any] = _state.setdefault("contexts", {})
        context = contexts.get(ordinal)
        if context is None:
            device = _call("cuDeviceGet", ordinal)
            context = contexts[ordinal] = _call("cuDevicePrimaryCtxRetain", device)
    _call("cuCtxPushCurrent", context)
    try:
        yield driver
    finally:
        _call("cuCtxPopCurrent")


def _fd_type(driver: Any) -> Any:
    return driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _properties(driver: Any, ordinal: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = _fd_type(driver)
    return prop


def granularity(ordinal: int) -> int:
    """The allocation granularity of a shareable allocation on GPU ``ordinal``."""
    with _on_device(ordinal) as driver:
        flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(_call("cuMemGetAllocationGranularity", _properties(driver, ordinal), flag))


def allocation_size(ordinal: int, nbytes: int) -> int:
    step = granularity(ordinal)
    return max(step, -(-nbytes // step) * step)


@dataclass(frozen=True)
class Exported:
    """A new shareable allocation, as its descriptor (which keeps it alive) and its size."""

    fd: int
    size: int


def create_exported(ordinal: int, nbytes: int) -> tuple[Exported, DeviceMapping]:
    """A shareable allocation of at least ``nbytes`` on GPU ``ordinal``: its descriptor, and
    its mapping read-write in this process. The allocation handle itself is released at once:
    the descriptor and the mapping are what keep it."""
    size = allocation_size(ordinal, nbytes)
    with _on_device(ordinal) as driver:
        handle = _call("cuMemCreate", size, _properties(driver, ordinal), 0)
        try:
            fd = int(_call("cuMemExportToShareableHandle", handle, _fd_type(driver), 0))
            try:
                mapping = _map(driver, handle, size, ordinal, writable=True)
            except BaseException:
                os.close(fd)
                raise
        finally:
            _call("cuMemRelease", handle)
    return Exported(fd, size), mapping


def map_fd(fd: int, size: int, ordinal: int, writable: bool) -> DeviceMapping:
    """Import the allocation behind descriptor ``fd`` (left open: the caller's) and map its
    ``size`` bytes on GPU ``ordinal``; read-only unless ``writable`` (where the driver takes
    read-only access; ``DeviceMapping.read_only`` says)."""
    with _on_device(ordinal) as driver:
        handle = _call("cuMemImportFromShareableHandle", fd, _fd_type(driver))
        try:
            return _map(driver, handle, size, ordinal, writable)
        finally:
            _call("cuMemRelease", handle)


def _map(driver: Any, handle: Any, size: int, ordinal: int, writable: bool) -> DeviceMapping:
    ptr = _call("cuMemAddressReserve", size, 0, 0, 0)
    try:
        _call("cuMemMap", ptr, size, 0, handle, 0)
        try:
            read_only = not writable and _set_access(driver, ptr, size, ordinal, read_only=True)
            if not read_only:
                _set_access(driver, ptr, size, ordinal, read_only=False)
        except BaseException:
            _call("cuMemUnmap", ptr, size)
            raise
    except BaseException:
        _call("cuMemAddressFree", ptr, size)
        raise
    return DeviceMapping(int(ptr), size, ordinal, read_only)


def _set_access(driver: Any, ptr: Any, size: int, ordinal: int, read_only: bool) -> bool:
    """Make the range accessible from GPU ``ordinal``, read-only if asked; False when the
    driver does not take read-only access there (the caller maps it read-write instead)."""
    access = driver.CUmemAccessDesc()
    access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = ordinal
    flags = driver.CUmemAccess_flags
    access.flags = (
        flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        if read_only
        else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    )
    try:
        _call("cuMemSetAccess", ptr, size, [access], 1)
    except CudaDriverError:
        if read_only:
            return False
        raise
    return True


def _unmap(ptr: int, size: int, ordinal: int) -> None:
    """Wait for the device (work queued on the range may still run), then unmap and free the
    address range. Runs when the last tensor over the mapping is gone."""
    with _on_device(ordinal):
        _call("cuCtxSynchronize")
        _call("cuMemUnmap", ptr, size)
        _call("cuMemAddressFree", ptr, size)


class DeviceMapping:
    """A mapped allocation, exposed to torch through ``__cuda_array_interface__``. Tensors made
    from it (:meth:`tensor`) keep it alive; it is unmapped once the last of them is gone (not
    at interpreter exit, when the driver tears everything down anyway)."""

    def __init__(self, ptr: int, size: int, ordinal: int, read_only: bool = False) -> None:
        self.ptr = ptr
        self.size = size
        self.ordinal = ordinal
        self.read_only = read_only  # the GPU faults on a write through this mapping
        self._finalizer = weakref.finalize(self, _unmap, ptr, size, ordinal)
        self._finalizer.atexit = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }

    def tensor(self) -> torch.Tensor:
        """The whole mapping as a 1-D uint8 CUDA tensor (zero copy: the tensor holds this
        object, and the range is unmapped when the last view of it is gone)."""
        tensor = torch.as_tensor(self)
        if tensor.data_ptr() != self.ptr or tensor.device != torch.device("cuda", self.ordinal):
            raise CudaDriverError(
                f"torch wrapped the mapping at {tensor.device}:{tensor.data_ptr():#x}, not "
                f"cuda:{self.ordinal}:{self.ptr:#x}",
                call="torch.as_tensor",
            )
        return tensor

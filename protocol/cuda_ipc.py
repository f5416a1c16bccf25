"""CUDA IPC handles as JSON, both ways.

Export is ``torch.multiprocessing.reductions.reduce_tensor`` of the arena's byte tensor, taken
afresh for every lease so torch's IPC reference counting counts every consumer (vLLM PR #56472 is
the use-after-free sharing one export caused). Import is ``rebuild_cuda_tensor`` called with a
fixed tensor class, storage class and dtype: nothing from the wire chooses code to run.
"""

from __future__ import annotations

import base64

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from protocol.schemas.manifest import CudaIpcHandle


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text.encode("ascii"), validate=True)


def export_cuda_arena(base: torch.Tensor, device_uuid: str) -> CudaIpcHandle:
    """A fresh IPC export of the 1-D uint8 arena tensor ``base``."""
    if base.dtype != torch.uint8 or base.dim() != 1 or not base.is_cuda:
        raise ValueError("an arena is a 1-D uint8 CUDA tensor")
    _, args = reduce_tensor(base)  # type: ignore[no-untyped-call]
    (
        _cls,
        size,
        _stride,
        tensor_offset,
        _storage_cls,
        _dtype,
        _device,
        handle,
        storage_size,
        storage_offset,
        _grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return CudaIpcHandle(
        device_uuid=device_uuid,
        storage_handle=_b64(handle) or "",
        storage_size_bytes=storage_size,
        storage_offset_bytes=storage_offset,
        ref_counter_handle=_b64(ref_handle) or "",
        ref_counter_offset=ref_offset,
        event_handle=_b64(event_handle),
        event_sync_required=bool(event_sync),
        tensor_offset=tensor_offset,
        tensor_size=int(size[0]),
    )


def release_cuda_export(handle: CudaIpcHandle) -> None:
    """What a consumer does when it drops a rebuilt storage, without opening it: decrement the
    export's slot in torch's reference-counter file, so the producer can free the memory."""
    torch.UntypedStorage._release_ipc_counter_cuda(
        _unb64(handle.ref_counter_handle), handle.ref_counter_offset
    )


def open_cuda_arena(handle: CudaIpcHandle, device_index: int) -> torch.Tensor:
    """Map a leased arena into this process on its own CUDA ``device_index`` (zero copy)."""
    tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor,
        (handle.tensor_size,),
        (1,),
        handle.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device_index,
        _unb64(handle.storage_handle),
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        _unb64(handle.ref_counter_handle),
        handle.ref_counter_offset,
        _unb64(handle.event_handle),
        handle.event_sync_required,
    )
    return tensor

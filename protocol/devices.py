"""How both sides name the devices arenas live on.

GPUs are named by UUID (``GPU-...``): the daemon and an engine may number them differently
(``CUDA_VISIBLE_DEVICES``), so an engine finds its own index for a leased arena by UUID. The CPU
twin is named by the kernel's boot id, which every process and container on one host shares.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.schemas.manifest import DeviceIdentity, DeviceKind

_KERNEL_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    try:
        return "host-" + _KERNEL_BOOT_ID.read_text().strip()
    except OSError:
        return "host-" + platform.node()


def cuda_uuid(index: int) -> str:
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def cuda_index_for_uuid(uuid: str) -> int | None:
    """This process's CUDA index of the GPU with ``uuid``, or None if it cannot see it."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if cuda_uuid(index) == uuid:
            return index
    return None


@dataclass(frozen=True)
class Placement:
    """Where one TP rank's arena goes."""

    kind: DeviceKind
    index: int | None = None

    def identity(self) -> DeviceIdentity:
        if self.kind is DeviceKind.cpu:
            return DeviceIdentity(
                kind=DeviceKind.cpu,
                name="host shared memory",
                uuid=host_id(),
                compute_capability=None,
                index=None,
            )
        assert self.index is not None
        props = torch.cuda.get_device_properties(self.index)
        return DeviceIdentity(
            kind=DeviceKind.cuda,
            name=props.name,
            uuid=cuda_uuid(self.index),
            compute_capability=f"{props.major}.{props.minor}",
            index=self.index,
        )

"""Where a donated rank's arena lives: host shared memory for a donor on the CPU; for a donor on
a GPU a shareable allocation on that GPU (``VmmArena``), made and exported as the daemon's own
GPU models are, so the keeper holds it across a restart as it holds theirs. Either way the
handle socket passes the offer's donor a descriptor it maps read-write (for the offer's secret,
as it passes a lease's holder one it maps read-only), and the offer, the commit and the keeper
treat both kinds alike (:mod:`service.registry.donations`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol.devices import Placement, cuda_index_for_uuid
from protocol.errors import DonationDeviceError, InvalidRequestError
from protocol.schemas.donated import DonationKey
from protocol.schemas.manifest import ArenaHandle, DeviceKind, HandleAccess
from service.memory.arena import Arena, VmmArena, allocate_arena
from service.memory.devices import places_on_gpu
from service.memory.digest import kept_digest
from service.memory.layout import ArenaLayout
from service.memory.shm import ArenaDir
from service.registry.loader import make_room


def gpu_placement(key: DonationKey, device: str, cuda_handles: str) -> Placement:
    """The GPU ``key``'s donor runs on, as this daemon numbers it, where the daemon holds arenas
    there as descriptors; else :class:`DonationDeviceError` saying why not."""
    uuid = key.device_uuid
    if cuda_handles != "fd":
        raise DonationDeviceError(
            "this daemon lends GPU arenas over legacy CUDA IPC (--cuda-handles ipc); a donor "
            "writes a shareable allocation passed as a descriptor",
            device=uuid,
        )
    if device == "cpu" or not torch.cuda.is_available():
        raise DonationDeviceError(
            f"this daemon holds arenas in host shared memory only (--device {device}, "
            f"{torch.cuda.device_count()} GPUs visible)",
            device=uuid,
        )
    index = cuda_index_for_uuid(uuid or "")
    if index is None:
        raise DonationDeviceError(
            f"GPU {uuid} is not visible to this daemon (--device {device})", device=uuid
        )
    if not places_on_gpu(device, index):
        raise DonationDeviceError(
            f"this daemon holds no arenas on GPU {uuid} (--device {device})", device=uuid
        )
    placement = Placement(DeviceKind.cuda, index)
    gpu = placement.identity()
    if (gpu.name, gpu.compute_capability) != (key.device_name, key.compute_capability):
        raise InvalidRequestError.of_field(
            "key.device_name",
            f"GPU {uuid} is a {gpu.name} of compute capability {gpu.compute_capability}, not "
            f"the {key.device_name} ({key.compute_capability}) the key names",
            "value_error",
        )
    return placement


@dataclass(frozen=True)
class DonationArenas:
    """The daemon's settings and parts a donation's arena needs."""

    device: str  # --device
    cuda_handles: str  # --cuda-handles
    boot_id: str
    arena_dir: Callable[[], ArenaDir | None]
    access: Callable[[str], HandleAccess | None]  # the handle socket, for a secret

    def placement(self, key: DonationKey) -> Placement:
        """Where ``key``'s arena goes (a typed refusal where this daemon cannot hold it)."""
        if key.device_kind == DeviceKind.cpu.value:
            return Placement(DeviceKind.cpu)
        return gpu_placement(key, self.device, self.cuda_handles)

    def make_room(
        self,
        placement: Placement,
        nbytes: int,
        make_free: Callable[[Placement, int, Callable[[], int]], int],
    ) -> None:
        """Room for ``nbytes`` of arena at ``placement``, evicting through ``make_free``."""
        make_room(placement, nbytes, self.arena_dir(), make_free)

    def allocate(self, layout: ArenaLayout, placement: Placement, label: str) -> Arena:
        return allocate_arena(
            layout, placement, self.arena_dir(), self.boot_id, label, self.cuda_handles
        )

    def digest(self, arena: Arena) -> str | None:
        """What a new daemon checks when it adopts ``arena`` from the keeper
        (:func:`~service.memory.digest.kept_digest`), taken once the donor wrote it; on a GPU
        its scratch given back, so that the daemon's footprint stays its arenas."""
        digest = kept_digest(arena)
        if isinstance(arena, VmmArena):
            torch.cuda.empty_cache()
        return digest

    def handle(self, arena: Arena, secret: str) -> ArenaHandle:
        """What the offer names: ``arena`` and the handle socket its donor asks with
        ``secret``."""
        access = self.access(secret)
        if access is None and isinstance(arena, VmmArena):
            raise DonationDeviceError("the daemon's handle socket is not serving yet")
        return arena.export(access)

"""Where a donation's arena goes: host shared memory for a CPU key; for a GPU key the donor's
own GPU, and only on a daemon that holds arenas there as descriptors (a typed refusal naming why
otherwise, before anything is registered)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.donating import ABSENT_GPU, key_for
from protocol.devices import Placement
from protocol.errors import DonationDeviceError
from protocol.schemas.donated import DonationKey
from protocol.schemas.manifest import DeviceKind, HandleAccess
from service.memory.devices import places_on_gpu
from service.registry.donation_arenas import DonationArenas, gpu_placement


def _arenas(device: str, cuda_handles: str = "fd") -> DonationArenas:
    def access(secret: str) -> HandleAccess:
        return HandleAccess(socket="/run/handles.sock", secret=secret)

    return DonationArenas(device, cuda_handles, "b00t", lambda: None, access)


def test_a_key_names_its_gpu_and_only_a_gpu_key_does(tiny_fp8: Path) -> None:
    assert key_for(tiny_fp8, **ABSENT_GPU).device_uuid == ABSENT_GPU["device_uuid"]
    with pytest.raises(ValueError, match="device_uuid"):
        key_for(tiny_fp8, **{**ABSENT_GPU, "device_uuid": None})
    with pytest.raises(ValueError, match="device_uuid"):
        key_for(tiny_fp8, device_uuid=ABSENT_GPU["device_uuid"])  # a CPU key
    # The GPU is compared: the same rank on another GPU is another donated model.
    other = key_for(
        tiny_fp8, **{**ABSENT_GPU, "device_uuid": "GPU-ffffffff-1111-2222-3333-444444444444"}
    )
    assert key_for(tiny_fp8, **ABSENT_GPU).differences(other) == ["device_uuid"]
    assert DonationKey.model_validate_json(other.model_dump_json()) == other


def test_the_device_setting_says_which_gpus_hold_arenas() -> None:
    assert not places_on_gpu("cpu", 0)
    assert places_on_gpu("cuda", 3)
    assert places_on_gpu("cuda:1", 1) and not places_on_gpu("cuda:1", 0)
    assert places_on_gpu("auto", 0) == torch.cuda.is_available()


def test_a_cpu_key_goes_to_shared_memory_on_any_daemon(tiny_fp8: Path) -> None:
    for device in ("cpu", "auto", "cuda:0"):
        assert _arenas(device).placement(key_for(tiny_fp8)) == Placement(DeviceKind.cpu)


@pytest.mark.parametrize(
    ("device", "cuda_handles", "why"),
    [
        ("cpu", "fd", "host shared memory only (--device cpu"),
        ("cuda:0", "ipc", "legacy CUDA IPC (--cuda-handles ipc)"),
    ],
)
def test_a_gpu_key_is_refused_where_the_daemon_holds_no_arena_there(
    tiny_fp8: Path, device: str, cuda_handles: str, why: str
) -> None:
    with pytest.raises(
        DonationDeviceError, match=why.replace("(", r"\(").replace(")", r"\)")
    ) as err:
        gpu_placement(key_for(tiny_fp8, **ABSENT_GPU), device, cuda_handles)
    assert err.value.extra["device"] == ABSENT_GPU["device_uuid"]
    assert err.value.status == 409 and "--cuda-handles fd" in err.value.hint


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a GPU")
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_gpu_key_is_refused_on_a_host_without_gpus(tiny_fp8: Path, device: str) -> None:
    with pytest.raises(DonationDeviceError, match="host shared memory only"):
        _arenas(device).placement(key_for(tiny_fp8, **ABSENT_GPU))

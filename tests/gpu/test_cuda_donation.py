"""Donations from a GPU at the daemon and engine level, with real CUDA tensors (run on a GPU):
the donor copies its tensors on the GPU into a shareable allocation the daemon made on that GPU
and the handle socket passed it read-write; the daemon checks every checksum over the arena at
the commit (and refuses bytes that do not match); an attacher maps it read-only, zero-copy,
every byte equal; the donated model outlives a kill -9 of the daemon under the keeper (its
digest checked at adoption); a daemon lending GPU arenas over legacy IPC refuses, typed."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine_client.arenas import open_arena
from engine_client.attach import Attachment, attach
from engine_client.client import ClientConfig, DaemonClient
from engine_client.donations import commit_call, donated_specs, offer_call, storage_span
from engine_client.verify import Expectations
from harness.daemon_process import DaemonProcess, KeptDaemons, start_daemon
from harness.donating import donate_tensors, gpu_fields, key_for, some_tensors, state_of
from protocol.dtypes import to_wire
from protocol.errors import DonationDeviceError, DonationInvalidError
from protocol.schemas.donated import DONATED_KERNEL
from protocol.schemas.donations import DonationCommit, DonationRequest
from protocol.schemas.manifest import ArenaDescriptor, CudaFdHandle, TensorEntry

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda", 0)


def on_gpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on GPU 0, strides kept (a transposed weight stays transposed)."""
    return {name: tensor.to(GPU) for name, tensor in tensors.items()}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tmp_path, [], device="cuda:0", timeout_s=300)
    yield process
    process.stop()


def _attach(url: str, model: str) -> Attachment:
    """A lease on the donated model ``model`` on GPU 0, every byte checked against its
    checksum."""
    expect = Expectations(
        GPU, kernel=DONATED_KERNEL, supported_schemes=frozenset(), verify_checksums=True
    )
    return attach(model, expect, config=ClientConfig.from_env(url=url))


def _equal(attachment: Attachment, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        leased = attachment.tensors[name]
        assert leased.device == GPU, name
        assert leased.stride() == tensor.stride(), name
        assert torch.equal(leased, tensor), name


def test_a_gpu_donation_is_copied_on_the_gpu_and_leased_zero_copy(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    tensors = on_gpu(some_tensors())
    allocated = torch.cuda.memory_allocated(GPU)
    model = donate_tensors(daemon.url, key_for(tiny_fp8, **gpu_fields(0)), tensors)
    # The copy went straight into the daemon's allocation: nothing staged in this process's
    # allocator is left, and nothing went through the host.
    assert torch.cuda.memory_allocated(GPU) == allocated
    with _attach(daemon.url, model) as attachment:
        assert attachment.zero_copy()
        assert attachment.arena.via == "descriptor" and attachment.arena.read_only
        _equal(attachment, tensors)
        with httpx.Client(base_url=daemon.url) as http:
            info = http.get(f"/v1/models/{model}").json()
            devices = http.get("/v1/inventory").json()["devices"]
        assert info["state"] == "ready" and info["active_leases"] == 1
        assert info["donor"]["pid"] == os.getpid()
        assert info["bytes_resident"] >= sum(
            storage_span(t).numel() * t.element_size() for t in tensors.values()
        )
        assert devices[0]["uuid"] == gpu_fields(0)["device_uuid"]


def test_bytes_that_do_not_match_their_checksums_are_refused_on_the_gpu(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """The daemon checks the arena on the GPU, not what the donor says it wrote: a commit whose
    checksum does not match the bytes in the arena is refused and the donation dropped."""
    tensors = on_gpu(some_tensors())
    config = ClientConfig.from_env(url=daemon.url)
    request = DonationRequest(
        key=key_for(tiny_fp8, **gpu_fields(0)),
        tensors=donated_specs(tensors),
        client_pid=os.getpid(),
    )
    with DaemonClient(config) as client:
        offer = client.send(offer_call(request))
        assert isinstance(offer.handle, CudaFdHandle)
        descriptor = ArenaDescriptor(index=0, nbytes=offer.nbytes, handle=offer.handle)
        opened = open_arena(descriptor, offer.model, writable=True)
        assert opened.base is not None and opened.base.device == GPU and not opened.read_only
        entries = []
        for name, tensor in tensors.items():
            span = storage_span(tensor).reshape(-1).view(torch.uint8)
            offset = offer.offsets[name]
            opened.base[offset : offset + span.numel()].copy_(span)
            entries.append(
                TensorEntry(
                    name=name,
                    arena=0,
                    offset=offset,
                    nbytes=span.numel(),
                    dtype=to_wire(tensor.dtype),
                    shape=list(tensor.shape),
                    stride=list(tensor.stride()),
                    checksum="0" * 16,  # not what was written
                )
            )
        torch.cuda.synchronize(GPU)
        opened.close()
        commit = DonationCommit(secret=offer.secret, tensors=entries, state=state_of(tensors))
        with pytest.raises(DonationInvalidError, match="do not match its checksum"):
            client.send(commit_call(offer.model, commit, client.config.timeout_s))
    with httpx.Client(base_url=daemon.url) as http:
        assert http.get("/v1/donations").json() == []


def test_a_gpu_donation_survives_a_kill_of_the_daemon_under_the_keeper(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    tensors = on_gpu(some_tensors(seed=3))
    with KeptDaemons(tmp_path, tiny_fp8, "cuda:0") as kept:
        model = donate_tensors(kept.first.url, key_for(tiny_fp8, **gpu_fields(0)), tensors)
        kept.first.stop(signal.SIGKILL)
        second = kept.restart()
        assert f"adopted {model} from the keeper" in second.log.read_text()
        with httpx.Client(base_url=second.url) as http:
            info = http.get(f"/v1/models/{model}").json()
        assert info["state"] == "ready", info
        assert info["donor"]["pid"] == os.getpid()
        with _attach(second.url, model) as attachment:
            _equal(attachment, tensors)


def test_a_daemon_lending_gpu_arenas_over_legacy_ipc_refuses_a_gpu_donation(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    daemon = start_daemon(tmp_path, [], "--cuda-handles", "ipc", device="cuda:0", timeout_s=300)
    try:
        with pytest.raises(DonationDeviceError, match="legacy CUDA IPC"):
            donate_tensors(daemon.url, key_for(tiny_fp8, **gpu_fields(0)), on_gpu(some_tensors()))
        with httpx.Client(base_url=daemon.url) as http:
            assert http.get("/v1/donations").json() == []
    finally:
        daemon.stop()

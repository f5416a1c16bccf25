"""Donated models in a real daemon: donated, leased, listed with their donor, checked by their
checksums, unloaded, and kept across a daemon restart under a keeper; the pending arena passed
to its donor alone, read-write, by the handle socket; a GPU donation refused, typed, by a daemon
that holds no arena on that GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine_client.arenas import open_arena
from engine_client.attach import Attachment, attach
from engine_client.client import ClientConfig, DaemonClient
from engine_client.donations import abandon_call, donated_specs, offer_call
from engine_client.verify import Expectations
from harness.daemon_process import DaemonProcess, KeptDaemons, lease_body, start_daemon
from harness.donating import ABSENT_GPU, donate_tensors, key_for, some_tensors
from harness.hostile.handle_holder import present_elsewhere
from protocol.errors import DonationDeviceError, HandleRefusedError
from protocol.handle_socket import fetch_arena_fd
from protocol.schemas.donated import DONATED_KERNEL
from protocol.schemas.donations import DonationRequest
from protocol.schemas.manifest import ArenaDescriptor, HandleAccess, ShmHandle


@pytest.fixture
def daemon(tmp_path: Path, tiny_fp8: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tmp_path, [tiny_fp8], "--model-id", "tiny")
    yield process
    process.stop()


def _attach(url: str, model: str) -> Attachment:
    """A lease on the donated model ``model``, every byte checked against its checksum."""
    expect = Expectations(
        torch.device("cpu"),
        kernel=DONATED_KERNEL,
        supported_schemes=frozenset(),
        verify_checksums=True,
    )
    return attach(model, expect, config=ClientConfig.from_env(url=url))


def test_a_donation_is_leased_zero_copy_with_its_bytes(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    tensors = some_tensors()
    model = donate_tensors(daemon.url, key_for(tiny_fp8), tensors)
    with _attach(daemon.url, model) as attachment:
        assert attachment.zero_copy()
        for name, tensor in tensors.items():
            leased = attachment.tensors[name]
            assert leased.stride() == tensor.stride()
            assert torch.equal(leased, tensor)
        with httpx.Client(base_url=daemon.url) as http:
            info = http.get(f"/v1/models/{model}").json()
            listed = http.get("/v1/donations").json()
            inventory = http.get("/v1/inventory").json()
        assert info["state"] == "ready" and info["active_leases"] == 1
        assert info["donor"]["uid"] == os.geteuid() and info["donor"]["pid"] == os.getpid()
        assert [d["model"] for d in listed] == [model]
        assert model in {m["id"] for m in inventory["models"]}


def test_a_modelopt_lease_on_a_donated_model_is_refused(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """A donated model serves its donor's kernels, never the daemon's CUTLASS layout."""
    model = donate_tensors(daemon.url, key_for(tiny_fp8))
    with httpx.Client(base_url=daemon.url) as http:
        r = http.post("/v1/leases", json=lease_body(model))
    assert r.status_code == 409 and r.json()["code"] == "layout_mismatch"
    assert r.json()["mismatches"]["kernel"] == {"requested": "cutlass", "served": "donated"}


def test_a_donated_model_unloads(daemon: DaemonProcess, tiny_fp8: Path) -> None:
    model = donate_tensors(daemon.url, key_for(tiny_fp8))
    with httpx.Client(base_url=daemon.url) as http:
        assert http.delete(f"/v1/models/{model}").status_code == 204
        assert http.get("/v1/donations").json() == []
    # Gone, it may be donated again.
    assert donate_tensors(daemon.url, key_for(tiny_fp8)) == model


def test_a_donated_model_survives_a_restart_under_the_keeper(
    tmp_path: Path, tiny_fp8: Path
) -> None:
    tensors = some_tensors(seed=3)
    with KeptDaemons(tmp_path, tiny_fp8) as kept:
        model = donate_tensors(kept.first.url, key_for(tiny_fp8), tensors)
        kept.first.stop()
        second = kept.restart()
        with httpx.Client(base_url=second.url) as http:
            info = http.get(f"/v1/models/{model}").json()
        assert info["state"] == "ready", info
        assert info["donor"]["pid"] == os.getpid()
        with _attach(second.url, model) as attachment:
            for name, tensor in tensors.items():
                assert torch.equal(attachment.tensors[name], tensor)


def test_a_pending_arena_goes_to_its_donor_alone_read_write(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """The donor maps the arena it is offered read-write through the handle socket (as a GPU
    donor maps a shareable allocation); a wrong secret, another process with the secret, and
    anyone once the donation is gone are refused."""
    tensors = some_tensors()
    request = DonationRequest(
        key=key_for(tiny_fp8), tensors=donated_specs(tensors), client_pid=os.getpid()
    )
    config = ClientConfig.from_env(url=daemon.url)
    with DaemonClient(config) as client:
        offer = client.send(offer_call(request))
    handle = offer.handle
    assert isinstance(handle, ShmHandle) and handle.access is not None
    access: HandleAccess = handle.access
    descriptor = ArenaDescriptor(index=0, nbytes=offer.nbytes, handle=handle)
    opened = open_arena(descriptor, offer.model, writable=True)
    assert opened.base is not None
    assert opened.via == "descriptor" and not opened.read_only
    opened.base[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    opened.close()

    with pytest.raises(HandleRefusedError) as err:
        fetch_arena_fd(access.model_copy(update={"secret": "x" * 32}), offer.model, 0)
    assert err.value.extra["why"] == "the secret is not this lease's"
    answer = present_elsewhere(access, offer.model)
    assert answer["code"] == "handle_refused" and "is not the lease's holder" in str(answer["why"])

    with DaemonClient(config) as client:
        client.send(abandon_call(offer.model, offer.secret))
    with pytest.raises(HandleRefusedError):  # no pending donation by that id any more
        fetch_arena_fd(access, offer.model, 0)


def test_a_gpu_donation_is_refused_by_a_daemon_on_the_cpu(
    daemon: DaemonProcess, tiny_fp8: Path
) -> None:
    """A key of a GPU asks for an arena on that GPU: a daemon on the CPU refuses it, typed and
    with its hint, and registers nothing."""
    with pytest.raises(DonationDeviceError) as err:
        donate_tensors(daemon.url, key_for(tiny_fp8, **ABSENT_GPU))
    assert "host shared memory only" in err.value.detail
    assert err.value.extra["device"] == ABSENT_GPU["device_uuid"]
    with httpx.Client(base_url=daemon.url) as http:
        assert http.get("/v1/donations").json() == []
        assert not [m for m in http.get("/v1/models").json() if m["donor"]]
        refused = http.post(
            "/v1/donations",
            json=DonationRequest(
                key=key_for(tiny_fp8, **ABSENT_GPU),
                tensors=donated_specs(some_tensors()),
                client_pid=os.getpid(),
            ).model_dump(mode="json"),
        )
    assert refused.status_code == 409 and refused.json()["code"] == "donation_device"
    assert refused.json()["hint"] == DonationDeviceError.hint

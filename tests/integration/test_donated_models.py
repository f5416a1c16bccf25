"""Donated models in a real daemon: donated, leased, listed with their donor, checked by their
checksums, unloaded, and kept across a daemon restart under a keeper."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine_client.attach import Attachment, attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from harness.daemon_process import DaemonProcess, KeptDaemons, lease_body, start_daemon
from harness.donating import donate_tensors, key_for, some_tensors
from protocol.schemas.donated import DONATED_KERNEL


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

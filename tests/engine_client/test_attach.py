"""Attaching from this (engine) process to a real daemon process: zero-copy tensors equal to an
ordinary load, lease kept alive and released, and every verification refusal leaving no lease."""

from __future__ import annotations

import dataclasses
import mmap
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine_client.attach import attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from harness.daemon_process import DaemonProcess
from harness.waiting import wait_for
from modelopt_fp8.checkpoint import Checkpoint, checkpoint_fingerprint
from modelopt_fp8.checkpoint.quant_config import QuantConfig
from modelopt_fp8.processing.execute import process_checkpoint
from modelopt_fp8.processing.plan import plan_model
from protocol.errors import LayoutMismatchError, VerificationError

CPU = torch.device("cpu")


def expectations(ckpt_path: Path, **over: Any) -> Expectations:
    return dataclasses.replace(Expectations.for_checkpoint(ckpt_path, CPU), **over)


def active_leases(daemon: DaemonProcess) -> list[dict[str, Any]]:
    return list(httpx.get(f"{daemon.url}/v1/leases").json())


def test_attached_tensors_are_the_ordinary_load_zero_copy(daemon_process, tiny_fp8) -> None:
    config = ClientConfig(url=daemon_process.url)
    with attach("tiny", expectations(tiny_fp8), config=config) as att:
        assert att.zero_copy()
        assert att.manifest.model == "tiny"
        with Checkpoint.open(tiny_fp8) as ckpt:
            plan = plan_model(ckpt)
            expected = process_checkpoint(ckpt, plan)
        assert att.layers == plan.layouts
        assert set(att.tensors) == set(expected)
        for name, want in expected.items():
            got = att.tensors[name]
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
            assert torch.equal(
                got.reshape(-1).view(torch.uint8) if got.dim() else got.view(1),
                want.reshape(-1).view(torch.uint8) if want.dim() else want.view(1),
            )
        assert len(active_leases(daemon_process)) == 1
        assert att.timings.attach_ms > 0 and att.nbytes == sum(
            t.nbytes for t in att.storages.values()
        )
    assert active_leases(daemon_process) == []


def test_keeper_renews_until_closed(daemon_process, tiny_fp8) -> None:
    config = ClientConfig(url=daemon_process.url)
    att = attach("tiny", expectations(tiny_fp8), config=config, ttl_s=0.3)
    first_expiry = att.grant.lease.expires_at
    try:
        # Until a renewal lands after the first TTL ran out: only renewals keep it alive so long.
        wait_for(
            lambda: any(
                lease["expires_at"] > first_expiry + 0.3 for lease in active_leases(daemon_process)
            ),
            timeout=30,
        )
        (lease,) = active_leases(daemon_process)
        assert lease["renewals"] >= 2 and att.keeper is not None and att.keeper.renewals >= 2
    finally:
        att.close()
    assert active_leases(daemon_process) == []


def test_checksums_verify_and_catch_corruption(daemon_process, tiny_fp8) -> None:
    config = ClientConfig(url=daemon_process.url)
    with attach("tiny", expectations(tiny_fp8, verify_checksums=True), config=config) as att:
        assert att.timings.checksum_ms > 0
        path = Path(att.grant.arenas[0].handle.path)  # type: ignore[union-attr]
    # Flip one byte of the daemon's arena behind its back (root can map it writable).
    fd = os.open(path, os.O_RDWR)
    with mmap.mmap(fd, 0) as m:
        m[0] ^= 0xFF
    os.close(fd)
    with pytest.raises(VerificationError) as err:
        attach("tiny", expectations(tiny_fp8, verify_checksums=True), config=config)
    assert err.value.reason == "checksum_mismatch"
    assert err.value.extra["tensor"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert active_leases(daemon_process) == []


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"tp_size": 2, "tp_rank": 1}, None),  # the daemon refuses: 409 layout_mismatch
        ({"fingerprint": "PC"}, "fingerprint_mismatch"),
        ({"quant": QuantConfig("FP8_PER_CHANNEL_PER_TOKEN", None, (), "x")}, "quant_algo_mismatch"),
        (
            {"quant": QuantConfig("FP8", None, ("model.layers.1.mlp.down_proj",), "x")},
            "scheme_mismatch",
        ),
        ({"device": torch.device("cuda", 0)}, "device_mismatch"),
    ],
)
def test_mismatches_are_refused_and_leave_no_lease(
    daemon_process, tiny_fp8, tiny_pc, over, reason
) -> None:
    if over.get("fingerprint") == "PC":
        over = {"fingerprint": checkpoint_fingerprint(tiny_pc)}
    config = ClientConfig(url=daemon_process.url)
    expected_error = VerificationError if reason else LayoutMismatchError
    with pytest.raises(expected_error) as err:
        attach("tiny", expectations(tiny_fp8, **over), config=config)
    if reason:
        assert err.value.extra["reason"] == reason
    assert active_leases(daemon_process) == []


def test_kernel_the_daemon_did_not_process_for(daemon_process, tiny_fp8) -> None:
    config = ClientConfig(url=daemon_process.url)
    with pytest.raises(LayoutMismatchError) as err:
        attach("tiny", expectations(tiny_fp8, kernel="marlin"), config=config)
    assert err.value.extra["mismatches"]["kernel"] == {"requested": "marlin", "served": "cutlass"}
    assert active_leases(daemon_process) == []


def test_tensors_outlive_their_attachment(daemon_process, tiny_fp8) -> None:
    """Closing releases the lease but never unmaps memory a caller still holds (an engine's
    parameters): reading it afterwards is safe and sees the same bytes."""
    att = attach("tiny", expectations(tiny_fp8), config=ClientConfig(url=daemon_process.url))
    weight = att.tensors[att.layers[0].weight]
    before = weight.float().sum().item()
    att.close()
    assert active_leases(daemon_process) == []
    assert weight.float().sum().item() == before

"""A second process playing the engine for the integration tests (run as a script).

``read``: lease, map the arena through its shared-memory handle, print every tensor's checksum
and dtype/shape/stride as JSON. ``write``: lease, map, and try to write into the arena (the
process must die from the protection fault). ``hold``: lease and sleep (to be killed).
``load CHECKPOINT [TIER]``: the engine's load policy (attach, else fall back to disk), printing
where the weights came from and why. ``attach-hold CHECKPOINT``: attach, print the first
weight's checksum, wait for a line on stdin, print it again. ``park CHECKPOINT [TIMEOUT]``: park
until released (or cancelled, or past the timeout), then load as ``load`` does (falling back
with the park's reason), print the outcome and wait for a line on stdin. ``slot DEVICE
[TIMEOUT]``: take the device's start-up slot, print whether it is held, wait for a line on
stdin, give it back.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import torch

from engine_client.attach import attach
from engine_client.checkpoint_read import attach_or_read, read_checkpoint
from engine_client.client import ClientConfig
from engine_client.fallback import record_fallback
from engine_client.parking import ParkingSpot, wait_until_released
from engine_client.startup_slot import take_startup_slot
from engine_client.verify import Expectations
from harness.daemon_process import lease_body
from modelopt_fp8.checkpoint import IdentityTier
from protocol.checksum import storage_checksum
from protocol.errors import ParkEndedError
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import ShmHandle
from protocol.shm import map_path


def lease(url: str, model: str, ttl: float = 60.0) -> LeaseGrant:
    r = httpx.post(f"{url}/v1/leases", json=lease_body(model, ttl_s=ttl))
    r.raise_for_status()
    return LeaseGrant.model_validate_json(r.content)


def engine_load(url: str, model: str, checkpoint: Path, tier: str) -> None:
    expect = Expectations.for_checkpoint(checkpoint, torch.device("cpu"), IdentityTier(tier))
    result = attach_or_read(model, checkpoint, expect, config=ClientConfig(url=url))
    print(json.dumps({"source": result.source, "reason": result.reason}), flush=True)
    if result.attachment is not None:
        result.attachment.close()


def attach_hold(url: str, model: str, checkpoint: Path) -> None:
    expect = Expectations.for_checkpoint(checkpoint, torch.device("cpu"))
    with attach(model, expect, config=ClientConfig(url=url)) as att:
        first = att.layers[0].weight
        print(json.dumps({"checksum": storage_checksum(att.storages[first])}), flush=True)
        sys.stdin.readline()
        print(json.dumps({"checksum": storage_checksum(att.storages[first])}), flush=True)


def park_then_load(url: str, model: str, checkpoint: Path, timeout_s: float | None) -> None:
    config = ClientConfig(url=url)
    spot = ParkingSpot(model, 0, 1, f"child-{os.getpid()}")
    out: dict[str, object] = {}
    try:
        released = wait_until_released(config, lambda: spot, timeout_s, poll_s=5.0)
    except ParkEndedError as exc:
        reason = record_fallback(exc, "loading from disk instead of attaching")
        read_checkpoint(checkpoint, torch.device("cpu"))
        out = {"cause": None, "source": "disk", "reason": reason.value}
    else:
        expect = Expectations.for_checkpoint(checkpoint, torch.device("cpu"))
        result = attach_or_read(model, checkpoint, expect, config=config)
        attachment = result.attachment
        out = {
            "cause": released.cause.value if released.cause else None,
            "source": result.source,
            "reason": result.reason.value if result.reason else None,
            "zero_copy": attachment.zero_copy() if attachment else False,
            "boot_id": attachment.grant.lease.boot_id if attachment else None,
        }
    print(json.dumps(out), flush=True)
    sys.stdin.readline()


def slot(url: str, device: str, timeout_s: float) -> None:
    held = take_startup_slot(ClientConfig(url=url), device, f"child-{os.getpid()}", 0, 1, timeout_s)
    print(json.dumps({"held": held is not None}), flush=True)
    sys.stdin.readline()
    if held is not None:
        held.give_back()
        print(json.dumps({"gave_back": True}), flush=True)


def main() -> None:
    mode, url, model = sys.argv[1:4]
    if mode == "park":
        timeout_s = float(sys.argv[5]) if len(sys.argv) > 5 else None
        park_then_load(url, model, Path(sys.argv[4]), timeout_s)
        return
    if mode == "slot":  # ``model`` is the device here
        slot(url, model, float(sys.argv[4]) if len(sys.argv) > 4 else 600.0)
        return
    if mode == "load":
        engine_load(url, model, Path(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "sampled")
        return
    if mode == "attach-hold":
        attach_hold(url, model, Path(sys.argv[4]))
        return
    grant = lease(url, model)
    handle = grant.arenas[0].handle
    assert isinstance(handle, ShmHandle)
    if mode == "hold":
        print(json.dumps({"lease": grant.lease.id}), flush=True)
        time.sleep(600)
    base = map_path(Path(handle.path), handle.size)
    if mode == "write":
        print("writing", flush=True)
        base[0] = 1  # PROT_READ mapping: this faults
        print("wrote", flush=True)
        return
    out = {}
    for t in grant.full_manifest().tensors:
        storage = base[t.offset : t.offset + t.nbytes]
        view = t.view(base)
        out[t.name] = {
            "checksum": storage_checksum(storage),
            "dtype": str(view.dtype).removeprefix("torch."),
            "shape": list(view.shape),
            "stride": list(view.stride()),
            "data_ptr_offset": view.data_ptr() - base.data_ptr(),
        }
    print(json.dumps({"lease": grant.lease.id, "tensors": out}), flush=True)
    assert torch.uint8 == base.dtype


if __name__ == "__main__":
    main()

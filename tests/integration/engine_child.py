"""A second process playing the engine for the integration tests (run as a script).

``read``: lease, map the arena through its shared-memory handle, print every tensor's checksum
and dtype/shape/stride as JSON. ``write``: lease, map, and try to write into the arena (the
process must die from the protection fault). ``hold``: lease and sleep (to be killed).
``load CHECKPOINT [TIER]``: the engine's load policy (attach, else fall back to disk), printing
where the weights came from and why. ``attach-hold CHECKPOINT``: attach, print the first
weight's checksum, wait for a line on stdin, print it again.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import torch

from engine_client.attach import attach
from engine_client.checkpoint_read import attach_or_read
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from modelopt_fp8.checkpoint import IdentityTier
from protocol.checksum import storage_checksum
from protocol.schemas.leases import LeaseGrant
from protocol.schemas.manifest import ShmHandle
from protocol.shm import map_read_only
from tests.daemon_process import lease_body


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


def main() -> None:
    mode, url, model = sys.argv[1:4]
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
    base = map_read_only(Path(handle.path), handle.size)
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

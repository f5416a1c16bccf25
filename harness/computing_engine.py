"""An engine that keeps computing on leased weights, for the restart tests (run as a script):
``python -m harness.computing_engine URL MODEL CHECKPOINT DEVICE``.

It attaches (renewing every 0.2 s), runs every layer's FP8 forward on a fixed input once as
its reference, then runs it again and again in a thread, comparing each result with the
reference bitwise. It prints one JSON line on attach, and one per line it reads on stdin:
``status`` (iterations, mismatches, renewals, the daemon that renewed last, whether the lease
was lost), ``close`` (release the lease and exit).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from engine_client.attach import attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from weight_cache_cli.attach import run_layers


def main() -> None:
    url, model, checkpoint, device_name = sys.argv[1:5]
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]
    expect = Expectations.for_checkpoint(Path(checkpoint), device)
    att = attach(
        model, expect, config=ClientConfig(url=url, retries=0), ttl_s=30, renew_every_s=0.2
    )
    reference = run_layers(att.layers, att.tensors, device)
    counts = {"iterations": 0, "mismatches": 0}
    stop = threading.Event()

    def compute() -> None:
        while not stop.is_set():
            out = run_layers(att.layers, att.tensors, device)
            same = out.keys() == reference.keys() and all(
                torch.equal(out[k], reference[k]) for k in out
            )
            counts["iterations"] += 1
            counts["mismatches"] += 0 if same else 1

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    base = att.arena.base
    assert base is not None
    print(
        json.dumps(
            {
                "lease": att.lease_id,
                "boot": att.grant.lease.boot_id,
                "zero_copy": att.zero_copy(),
                "via": att.arena.via,
                "device": str(base.device),
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        keeper = att.keeper
        assert keeper is not None
        status: dict[str, Any] = {
            **counts,
            "renewals": keeper.renewals,
            "boot": keeper.boot_id,
            "unanswered": keeper.unanswered,
            "lost": att.lost.code if att.lost else None,
        }
        if line.strip() == "close":
            stop.set()
            worker.join(60)
            att.close()
            status["closed"] = True
            print(json.dumps(status), flush=True)
            return
        print(json.dumps(status), flush=True)


if __name__ == "__main__":
    main()

"""The engine process of the GPU lease tests (run as a script): attaches (descriptor or legacy
CUDA IPC, whichever the daemon lends), reports every tensor, how it opened the arena and its own
pid, then waits for a line on stdin and reports the first weight's bytes again."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from engine_client.attach import attach
from engine_client.client import ClientConfig
from engine_client.verify import Expectations
from protocol.checksum import storage_checksum


def main() -> None:
    url, model, checkpoint = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.cuda.init()
    expect = Expectations.for_checkpoint(checkpoint, torch.device("cuda", 0), verify_checksums=True)
    with attach(model, expect, config=ClientConfig(url=url)) as att:
        base = att.arena.base
        assert base is not None
        report = {
            "zero_copy": att.zero_copy(),
            "via": att.arena.via,
            "read_only": att.arena.read_only,
            "pid": os.getpid(),
            "device": str(base.device),
            "timings": {
                "lease_ms": att.timings.lease_ms,
                "open_ms": att.timings.open_ms,
                "rebuild_ms": att.timings.rebuild_ms,
                "checksum_ms": att.timings.checksum_ms,
            },
            "tensors": {
                name: {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "stride": list(t.stride()),
                    "offset": t.data_ptr() - base.data_ptr(),
                    "checksum": storage_checksum(att.storages[name]),
                }
                for name, t in att.tensors.items()
            },
        }
        print(json.dumps(report), flush=True)
        sys.stdin.readline()  # the daemon writes into its arena now
        first = att.manifest.layers[0].weight
        print(json.dumps({"checksum": storage_checksum(att.storages[first])}), flush=True)


if __name__ == "__main__":
    main()

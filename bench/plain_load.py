"""The loader the daemon competes with in plain torch: ``safetensors.load_file`` + ``.to(device)``,
then the same processing done in torch on the device.

Its bytes must equal the daemon's arena; the benchmark checks that they do, which keeps the
comparison honest.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.measure import log, sync
from harness.plain_processing import process_layer
from modelopt_fp8.processing.plan import ModelPlan
from service.registry.loader import ResidentRank


def plain_read(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor on ``device`` (``load_file`` only maps the file: the copy to the
    device, or ``.clone()`` on the CPU, is the read)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            tensors[name] = tensor.to(device) if device.type == "cuda" else tensor.clone()
    sync(device)
    return tensors


def plain_process(
    plan: ModelPlan, tensors: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """The processing in plain torch on ``device``: slice, fuse, pad, and each layer's
    scheme's processing in torch (:func:`harness.plain_processing.process_layer`); returns
    every storage."""
    out: dict[str, torch.Tensor] = {}
    for lp in plan.linears:
        parts = [
            tensors[s.weight][s.slice.rows[0] : s.slice.rows[1], s.slice.cols[0] : s.slice.cols[1]]
            for s in lp.shards
        ]
        out.update(process_layer(lp.scheme, lp, parts, lp.shard_scales(plan.scales), device))
        if lp.bias is not None:
            biases = [tensors[s.bias or ""][s.slice.rows[0] : s.slice.rows[1]] for s in lp.shards]
            out[lp.bias.name] = torch.cat(biases)
    for cp in plan.carried:
        out[cp.spec.name] = tensors[cp.source]
    sync(device)
    return out


def same_bytes(
    ranks: list[ResidentRank], plan: ModelPlan, storages: dict[str, torch.Tensor]
) -> bool:
    arena = ranks[0].arena
    for spec in plan.specs:
        ours = arena.storage(spec).reshape(-1).view(torch.uint8)
        theirs = storages[spec.name].contiguous().reshape(-1).view(torch.uint8).to(ours.device)
        if not torch.equal(ours, theirs):
            log(f"  bytes differ: {spec.name}")
            return False
    return True

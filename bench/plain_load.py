"""The loader the daemon competes with in plain torch: ``safetensors.load_file`` + ``.to(device)``,
then the same processing done in torch on the device.

It uses the daemon's code maps, so its bytes must equal the daemon's arena; the benchmark checks
that they do, which keeps the comparison honest.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.measure import log, sync
from modelopt_fp8.processing import ModelPlan
from modelopt_fp8.processing.execute import requantize_maps
from protocol.schemas.layout import Scheme
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
    """The processing in plain torch on ``device``: slice, fuse, requantize (the same code
    maps, gathered on the device), pad; returns every storage."""
    out: dict[str, torch.Tensor] = {}
    for lp in plan.linears:
        parts = [
            tensors[s.weight][s.slice.rows[0] : s.slice.rows[1], s.slice.cols[0] : s.slice.cols[1]]
            for s in lp.shards
        ]
        scheme = lp.layout.scheme
        if scheme is Scheme.fp8:
            max_scale, maps = requantize_maps(
                [plan.scales[s.weight_scale or ""] for s in lp.shards]
            )
            for i, code_map in enumerate(maps):
                if code_map is None:
                    continue
                codes = parts[i].contiguous().view(torch.uint8)
                if device.type == "cuda":
                    table = torch.from_numpy(code_map.table).to(device)
                    parts[i] = table[codes.long()].view(parts[i].dtype)
                else:  # torch gathers bytes slowly on the CPU: NumPy, as the daemon does
                    mapped = torch.empty_like(codes)
                    code_map.apply(codes.numpy(), mapped.numpy())
                    parts[i] = mapped.view(parts[i].dtype)
            assert lp.weight_scale is not None and lp.input_scale is not None
            out[lp.weight_scale.name] = max_scale.to(device)
            inputs = [plan.scales[s.input_scale or ""].reshape(()) for s in lp.shards]
            out[lp.input_scale.name] = torch.stack(inputs).max().to(device)
        elif scheme is Scheme.fp8_pc_pt:
            assert lp.weight_scale is not None
            scale = torch.ones(lp.weight_scale.storage_shape, dtype=torch.float32, device=device)
            rows = [
                plan.scales[s.weight_scale or ""].reshape(-1)[s.slice.rows[0] : s.slice.rows[1]]
                for s in lp.shards
            ]
            joined = torch.cat(rows).to(device)
            scale[: joined.numel()] = joined
            out[lp.weight_scale.name] = scale
        fused = torch.cat(parts)
        weight = torch.zeros(lp.weight.storage_shape, dtype=lp.weight.dtype, device=device)
        weight[: fused.shape[0], : fused.shape[1]] = fused
        out[lp.weight.name] = weight
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

"""A linear layer processed in plain torch on whole tensors, the way a loader without the fast
path would: the shards' rows fused and padded in one buffer on the device, then the layer's
scheme's ``process_in_torch``. The tests' plain path (``tests/reference_processing.py``) is
compared with the fast path byte for byte; the benchmarks' plain loader (``bench/plain_load.py``)
is what the daemon's load competes with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from modelopt_fp8.processing.tensor_spec import TensorSpec
from modelopt_fp8.schemes import LinearScheme
from modelopt_fp8.schemes.base import LaidOut, ShardScales, TorchLayer


def _storage(spec: TensorSpec | None, device: torch.device) -> torch.Tensor | None:
    return torch.empty(spec.storage_shape, dtype=spec.dtype, device=device) if spec else None


def process_layer(
    scheme: LinearScheme,
    laid: LaidOut,
    weights: Sequence[torch.Tensor],
    shards: Sequence[ShardScales],
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The storages of ``laid``'s weight and scales, by tensor name, made from each shard's
    weight rows of this rank (``weights``, ``[rows, K]``) and its scales."""
    device = torch.device(device)
    weight = torch.zeros(laid.weight.storage_shape, dtype=laid.weight.dtype, device=device)
    rows: list[torch.Tensor] = []
    start = 0
    for part in weights:
        end = start + part.shape[0]
        weight[start:end, : part.shape[1]] = part
        rows.append(weight[start:end, : part.shape[1]])
        start = end
    weight_scale = _storage(laid.weight_scale, device)
    input_scale = _storage(laid.input_scale, device)
    scheme.process_in_torch(TorchLayer(rows, shards, weight_scale, input_scale))
    out = {laid.weight.name: weight}
    for spec, storage in ((laid.weight_scale, weight_scale), (laid.input_scale, input_scale)):
        if spec is not None and storage is not None:
            out[spec.name] = storage
    return out
